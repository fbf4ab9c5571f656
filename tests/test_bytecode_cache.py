"""scripts/bytecode_cache.py: setup_env.sh's bytecode kept for the next fresh venv.

A fake uv cache holds a package's source files; two "venvs" link them (as uv does), one
compiles by importing (as compile_imports.py does), and its bytecode is saved and restored
into the other."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bytecode_cache.py"
_spec = importlib.util.spec_from_file_location("bytecode_cache", SCRIPT)
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)


def _venv(root: Path, uv: Path, name: str) -> Path:
    """A site-packages whose ``pkg`` files are links to ``uv``'s, plus one file of its own
    (as uv writes the editable install's finder)."""
    site = root / name
    (site / "pkg").mkdir(parents=True)
    for f in uv.iterdir():
        os.link(f, site / "pkg" / f.name)
    (site / "own.py").write_text(f"WHERE = {name!r}\n")
    return site


def _python(site: Path, code: str, write_bytecode: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(
        [sys.executable, "-v", "-c", code],
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )


def _pycs(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.pyc")}


@pytest.fixture
def two_venvs(tmp_path):
    uv = tmp_path / "uv"
    uv.mkdir()
    (uv / "__init__.py").write_text("")
    (uv / "m.py").write_text("VALUE = 1\n")
    first, second = _venv(tmp_path, uv, "first"), _venv(tmp_path, uv, "second")
    _python(first, "import pkg.m, own", write_bytecode=True)  # compile_imports.py's way
    return uv, first, second, tmp_path / "cache" / "cpython-x-stamp"


def test_saves_the_shared_files_bytecode_and_restores_it_where_none_is(two_venvs):
    uv, first, second, cache = two_venvs
    tag = sys.implementation.cache_tag
    shared = {f"pkg/__pycache__/__init__.{tag}.pyc", f"pkg/__pycache__/m.{tag}.pyc"}
    assert _pycs(first) == shared | {f"__pycache__/own.{tag}.pyc"}
    assert bc.save(first, cache) == 2
    assert _pycs(cache) == shared  # not own.py's: its file is the venv's alone
    assert bc.save(first, cache) == 0  # there already: left as it is
    assert bc.restore(second, cache) == 2
    assert _pycs(second) == shared
    assert bc.restore(second, cache) == 0  # bytecode there now: nothing overwritten
    # the restored bytecode is what the second venv's Python loads, writing none itself
    out = _python(second, "import pkg.m; print(pkg.m.VALUE)", write_bytecode=False)
    assert out.stdout.strip() == "1"
    pyc = second / "pkg" / "__pycache__" / f"m.{tag}.pyc"
    assert f"{pyc} matches {second / 'pkg' / 'm.py'}" in out.stderr
    assert f"code object from '{pyc}'" in out.stderr
    assert pyc.stat().st_ino == (cache / pyc.relative_to(second)).stat().st_ino


def test_a_changed_source_is_compiled_again_not_served_stale(two_venvs):
    uv, first, second, cache = two_venvs
    bc.save(first, cache)
    # uv unpacks the package again (new files, the same names): the saved bytecode is stale
    for site in (uv, second / "pkg"):
        (site / "m.py").unlink()
    (uv / "m.py").write_text("VALUE = 22\n")
    os.link(uv / "m.py", second / "pkg" / "m.py")
    assert bc.restore(second, cache) == 2
    out = _python(second, "import pkg.m; print(pkg.m.VALUE)", write_bytecode=False)
    assert out.stdout.strip() == "22"
    pyc = second / "pkg" / "__pycache__" / f"m.{sys.implementation.cache_tag}.pyc"
    assert f"code object from {second / 'pkg' / 'm.py'}\n" in out.stderr  # compiled again
    assert str(pyc) not in out.stderr  # its bytecode not loaded: stale (-v says "matches")


def test_restore_without_a_cache_and_bad_arguments(tmp_path, capsys):
    site = tmp_path / "site"
    site.mkdir()
    assert bc.main(["restore", str(site), str(tmp_path / "none")]) == 1  # setup compiles
    empty = tmp_path / "empty"
    empty.mkdir()
    assert bc.main(["restore", str(site), str(empty)]) == 1  # nothing restored: compiles
    assert bc.main(["load", str(site), str(empty)]) == 2
    assert "save|restore SITE_PACKAGES CACHE_FOLDER" in capsys.readouterr().err


def test_save_removes_the_caches_unused_for_two_weeks(two_venvs):
    uv, first, second, cache = two_venvs
    parent = cache.parent
    parent.mkdir(parents=True)
    stale, recent = parent / "cpython-x-old", parent / "cpython-y-used"
    for d in (stale, recent):
        (d / "pkg").mkdir(parents=True)
    old = time.time() - (bc.UNUSED_DAYS + 1) * 86400
    for d in (stale, recent):
        os.utime(d, (old, old))
    bc.restore(first, recent)  # a setup used it: kept
    bc.save(first, cache)
    assert sorted(p.name for p in parent.iterdir()) == ["cpython-x-stamp", "cpython-y-used"]
