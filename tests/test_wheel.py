"""The package as users get it: the wheel built from this tree, installed with its extras
into a fresh venv outside the tree, run from a folder outside the tree.

A copy of the tree (without its venvs, caches and build outputs: a stale ``*.egg-info``
would feed setuptools its old file list) is built as a user's ``uv build`` / ``python -m
build`` does, the sdist first and the wheel from it, so a file the sdist leaves out fails
too. The wheel goes into a new venv with ``[megatron,deepspeed]``, resolved against
``constraints.txt`` with the wheel folders ``scripts/setup_env.sh`` uses (pip's
``PIP_FIND_LINKS``, the Python 3.12 wheelhouse): uv links every dependency from its cache,
so the venv costs seconds, not downloads. Then, from an empty folder: ``startrail-plan``
prints what the tree's planner prints; the installed package is the fresh venv's (version,
distribution metadata, license, the dependencies' pinned releases), imports no torch until
a name needs it, and runs StarTrail's attention in one process against PyTorch's; and its
files are the tree's package files, byte for byte (every subpackage and every data file
the code reads, such as Megatron-LM's flag list)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

import startrail_megatron

ROOT = Path(__file__).resolve().parent.parent
PKG = "startrail_megatron"
EXTRAS = "megatron,deepspeed"
PLAN_ARGS = ["--cluster", "h100-ib", "--model", "gpt-7b", "--seq-len", "64K", "--cp-size", "32"]
"""The README's ``startrail-plan`` example."""

# What a fresh clone does not hold (.gitignore), besides any venv (a folder with pyvenv.cfg).
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", "data", "bench_out",
    ".cache", ".pytest_cache", ".ruff_cache",
)  # fmt: skip


def _ignore(folder: str, names: list[str]) -> set[str]:
    venvs = {n for n in names if os.path.isfile(os.path.join(folder, n, "pyvenv.cfg"))}
    return set(_NOT_SOURCE(folder, names)) | venvs


def _find_links() -> list[str]:
    """``scripts/setup_env.sh``'s extra wheel folders: ``UV_FIND_LINKS`` or else pip's
    ``PIP_FIND_LINKS`` (torch 2.13.0's CPU build on Python 3.11 here), and the wheelhouse
    holding torch's CUDA build for Python 3.12."""
    links = os.environ.get("UV_FIND_LINKS", "").replace(",", " ").split()
    links = links or os.environ.get("PIP_FIND_LINKS", "").split()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    house = os.environ.get("STARTRAIL_WHEELHOUSE") or os.path.join(
        cache, "startrail_megatron", "wheels"
    )
    return links + ([house] if os.path.isdir(house) else [])


def _run(cmd: list, cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    what = " ".join(map(str, cmd))[:300]
    assert out.returncode == 0, f"{what} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _user_env(venv: Path) -> dict[str, str]:
    """A shell with the fresh venv activated and nothing pointing at this tree; no bytecode
    written (the venv is thrown away: ~1000 files of torch's for nothing)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    path = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return {**env, "VIRTUAL_ENV": str(venv), "PATH": path, "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def installed():
    """(the fresh venv, an empty working folder outside the tree)."""
    uv = [sys.executable, "-m", "uv"]  # pinned in constraints.txt, installed by setup_env
    # DeepSpeed's sdist builds no ops (as in setup_env.sh) where uv's cache lacks its wheel
    uv_env = {**os.environ, "UV_FIND_LINKS": ",".join(_find_links()), "DS_BUILD_OPS": "0"}
    uv_env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryDirectory(prefix="startrail_wheel_") as tmp:
        tmp = Path(tmp)
        shutil.copytree(ROOT, tmp / "src", ignore=_ignore)
        _run([*uv, "build", "-q", "--out-dir", tmp / "dist", tmp / "src"], tmp, uv_env)
        (wheel,) = (tmp / "dist").glob("*.whl")
        venv = tmp / "venv"
        _run([*uv, "venv", "-q", "--python", sys.executable, venv], tmp, uv_env)
        constraints = ROOT / "constraints.txt"
        want = f"{PKG}[{EXTRAS}] @ {wheel.as_uri()}"
        _run(
            [*uv, "pip", "install", "-q", "--python", venv / "bin" / "python", "-c", constraints,
             want],
            tmp, uv_env,
        )  # fmt: skip
        work = tmp / "work"
        work.mkdir()
        yield venv, work


def test_startrail_plan_prints_what_the_tree_prints(installed):
    venv, work = installed
    got = _run(["startrail-plan", *PLAN_ARGS], work, _user_env(venv))
    assert shutil.which("startrail-plan", path=_user_env(venv)["PATH"]).startswith(str(venv))
    from startrail_megatron.planner import cli

    want = io.StringIO()
    with contextlib.redirect_stdout(want):
        assert cli.main(PLAN_ARGS) == 0
    assert got == want.getvalue()
    assert "seq 65536, batch 1, CP 32" in got and "\nrecommended: " in got, got
    assert {"startrail-bench", "startrail-preprocess-data"} <= set(os.listdir(venv / "bin"))


_IMPORT_CHECK = """
import json, sys
from importlib import metadata
import startrail_megatron as st
print(st.__version__, st.__file__)
out = {"version": st.__version__, "file": st.__file__, "torch_at_import": "torch" in sys.modules}
import torch
from startrail_megatron.one_process import one_process_attention
out["groups"] = st.StarTrailGroups.__module__
torch.manual_seed(0)
q, k, v = (torch.randn(32, 1, 4, 8, dtype=torch.float64) for _ in range(3))
shards = [[st.zigzag_shard(x, r, 4) for r in range(4)] for x in (q, k, v)]
got = st.zigzag_unshard(one_process_attention(*shards, team_size=2))
ref = torch.nn.functional.scaled_dot_product_attention(
    *(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True).permute(2, 0, 1, 3)
out["attention_error"] = (got - ref).abs().max().item()
out["dist_version"] = metadata.version("startrail_megatron")
meta = metadata.metadata("startrail_megatron")
out["license"] = [meta["License-Expression"], meta.get_all("License-File")]
dist = metadata.distribution("startrail_megatron")
out["license_text"] = dist.read_text("licenses/LICENSE")
out["versions"] = {n: metadata.version(n) for n in sys.argv[1:]}
print(json.dumps(out))
"""

PINNED = ("torch", "megatron-core", "deepspeed", "transformers", "einops", "pydantic")
"""Distributions the extras pull in, each at the release this tree's venv has."""


def test_the_installed_package_is_the_fresh_venvs(installed):
    venv, work = installed
    python = venv / "bin" / "python"
    lines = _run([python, "-I", "-c", _IMPORT_CHECK, *PINNED], work, _user_env(venv))
    first, report = lines.splitlines()[0], json.loads(lines.splitlines()[-1])
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert Path(report["file"]).is_relative_to(site / "site-packages" / PKG), first
    assert not Path(report["file"]).resolve().is_relative_to(ROOT)
    assert report["version"] == startrail_megatron.__version__ == report["dist_version"]
    assert first == f"{report['version']} {report['file']}"
    assert report["torch_at_import"] is False  # names resolve on first use
    assert report["groups"] == f"{PKG}.groups"
    assert report["attention_error"] < 1e-12, report["attention_error"]
    assert report["license"] == ["Apache-2.0", ["LICENSE"]]
    assert report["license_text"] == (ROOT / "LICENSE").read_text()
    assert report["versions"] == {n: metadata.version(n) for n in PINNED}


def _package_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_wheel_holds_every_file_of_the_package(installed):
    venv, _work = installed
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    got, want = _package_files(site / "site-packages" / PKG), _package_files(ROOT / PKG)
    assert sorted(set(want) - set(got)) == [], "missing from the wheel"
    assert sorted(set(got) - set(want)) == [], "in the wheel, not in the tree"
    assert [f for f in want if got[f] != want[f]] == [], "differ from the tree's"
    assert any(f.endswith(".txt") for f in got)  # data files are compared too
