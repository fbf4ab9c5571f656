"""scripts/bytecode_cache.py: setup_env.sh's bytecode kept for the next fresh venv.

A fake uv cache holds a package's source files; two "venvs" link them (as uv does), one
compiles by importing (as compile_imports.py does), and its bytecode is saved and restored
into the other."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from common import load_script

bc = load_script("bytecode_cache")


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
    assert bc.restore(second, cache) == (2, 0, 0)  # linked
    assert _pycs(second) == shared
    assert bc.restore(second, cache) == (0, 0, 0)  # bytecode there now: nothing overwritten
    # the restored bytecode is what the second venv's Python loads, writing none itself
    out = _python(second, "import pkg.m; print(pkg.m.VALUE)", write_bytecode=False)
    assert out.stdout.strip() == "1"
    pyc = second / "pkg" / "__pycache__" / f"m.{tag}.pyc"
    assert f"{pyc} matches {second / 'pkg' / 'm.py'}" in out.stderr
    assert f"code object from '{pyc}'" in out.stderr
    assert pyc.stat().st_ino == (cache / pyc.relative_to(second)).stat().st_ino


def _unpack_again(uv: Path, site: Path, text: str, same_time: bool = False) -> None:
    """uv unpacks ``m.py`` again (a new file of the same name) and ``site`` links it."""
    st = (uv / "m.py").stat()
    for d in (uv, site / "pkg"):
        (d / "m.py").unlink()
    (uv / "m.py").write_text(text)
    if same_time:
        os.utime(uv / "m.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.link(uv / "m.py", site / "pkg" / "m.py")


@pytest.mark.parametrize("same_time", [False, True], ids=["new-time", "same-time-and-size"])
def test_another_source_file_gets_its_own_bytecode(two_venvs, same_time):
    """A source unpacked again is another file: the saved bytecode is not linked, the new
    source is compiled instead. With the old file's time and size, Python's own check on
    import would have taken the stale bytecode (VALUE 1): only the file's identity tells."""
    uv, first, second, cache = two_venvs
    bc.save(first, cache)
    _unpack_again(uv, second, "VALUE = 2\n" if same_time else "VALUE = 22\n", same_time)
    assert bc.restore(second, cache) == (1, 1, 0)  # pkg/__init__'s linked, m's compiled
    pyc = second / "pkg" / "__pycache__" / f"m.{sys.implementation.cache_tag}.pyc"
    assert pyc.stat().st_ino != (cache / pyc.relative_to(second)).stat().st_ino
    out = _python(second, "import pkg.m; print(pkg.m.VALUE)", write_bytecode=False)
    assert out.stdout.strip() == ("2" if same_time else "22")
    assert f"code object from '{pyc}'" in out.stderr  # the bytecode compiled for it


def test_bytecode_whose_source_is_gone_or_changed_is_neither_linked_nor_saved(two_venvs):
    uv, first, second, cache = two_venvs
    tag = sys.implementation.cache_tag
    (first / "pkg" / "m.py").write_text("VALUE = 333\n")  # changed since it was compiled
    assert bc.save(first, cache) == 1  # pkg/__init__'s only
    assert _pycs(cache) == {f"pkg/__pycache__/__init__.{tag}.pyc"}
    bc.save(second, cache)  # (second's own, none: nothing compiled there) replaces it
    assert _pycs(cache) == set()
    _python(first, "import pkg.m", write_bytecode=True)  # compiled again
    bc.save(first, cache)
    (second / "pkg" / "m.py").unlink()  # the new venv's release has no such file
    assert bc.restore(second, cache) == (1, 0, 1)
    assert bc.main(["restore", str(second), str(cache)]) == 1  # so the setup compiles
    assert _pycs(second) == {f"pkg/__pycache__/__init__.{tag}.pyc"}


def test_exit_codes_for_the_setup(two_venvs, tmp_path, capsys):
    uv, first, second, cache = two_venvs
    assert bc.main(["restore", str(second), str(tmp_path / "none")]) == 1  # setup compiles
    assert bc.main(["save", str(first), str(cache)]) == 0
    assert bc.main(["restore", str(second), str(cache)]) == 0  # all linked: no compiling
    assert bc.main(["restore", str(second), str(cache)]) == 1  # nothing to link: compiles
    # a cache folder that cannot be made: said, and the setup goes on
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert bc.main(["save", str(first), str(blocker / "cache")]) == 0
    assert f"not saved to {blocker / 'cache'}" in capsys.readouterr().err
    assert bc.main(["load", str(first), str(cache)]) == 2
    assert "save|restore SITE_PACKAGES CACHE_FOLDER" in capsys.readouterr().err


def test_save_removes_the_caches_unused_for_two_weeks(two_venvs):
    uv, first, second, cache = two_venvs
    parent = cache.parent
    parent.mkdir(parents=True)
    stale, recent = parent / "cpython-x-old", parent / "cpython-y-used"
    for d in (stale, recent):
        (d / "pkg").mkdir(parents=True)
        (d / bc.MANIFEST).write_text("{}")
    old = time.time() - (bc.UNUSED_DAYS + 1) * 86400
    for d in (stale, recent):
        os.utime(d, (old, old))
    bc.restore(first, recent)  # a setup used it: kept
    bc.save(first, cache)
    assert sorted(p.name for p in parent.iterdir()) == ["cpython-x-stamp", "cpython-y-used"]
