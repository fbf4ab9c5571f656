"""Keeps the bytecode ``compile_imports.py`` wrote into a venv, for the next fresh venv.

uv links every installed file of a wheel from its cache (``~/.cache/uv``), so the site-packages
files of two venvs set up from the same pins are one file on disk, and the bytecode compiled
in one is valid in the other. ``save`` links each ``__pycache__/*.pyc`` whose source file is
such a shared file (a link count above one) into a cache folder; ``restore`` links them into a
new venv's site-packages where the source is present and no bytecode is yet. A setup that
restored skips ``compile_imports.py`` (~19 s of a core per lane).

Nothing stale can be served: a ``.pyc`` records its source's modification time and size, and
Python compiles the source again wherever they differ (a package re-unpacked by uv, a file
changed). Files uv writes itself (the editable install's finder, which names the clone's
path) are never shared and so never saved. A cache no setup used for two weeks is removed by
the next ``save``.

Usage: python bytecode_cache.py save|restore SITE_PACKAGES CACHE_FOLDER
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["restore", "save"]

UNUSED_DAYS = 14


def _source_of(pyc: Path) -> Path:
    """``pkg/__pycache__/mod.cpython-311.pyc`` -> ``pkg/mod.py``."""
    return pyc.parent.parent / (pyc.name.split(".", 1)[0] + ".py")


def _bytecode(root: Path):
    for dirpath, _dirs, files in os.walk(root):
        if os.path.basename(dirpath) == "__pycache__":
            for name in files:
                if name.endswith(".pyc"):
                    yield Path(dirpath, name)


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def save(site: Path, cache: Path) -> int:
    """Put the bytecode of ``site``'s shared source files in ``cache`` (made whole, then
    renamed into place: a setup running beside this one sees all of it or none). Returns
    how many files it holds; 0 if ``cache`` was there already."""
    if cache.exists():
        return 0
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
    n = 0
    for pyc in _bytecode(site):
        src = _source_of(pyc)
        if src.is_file() and src.stat().st_nlink > 1:
            _link(pyc, tmp / pyc.relative_to(site))
            n += 1
    try:
        tmp.rename(cache)
    except OSError:  # saved by a setup beside this one meanwhile
        shutil.rmtree(tmp)
        return 0
    _prune(cache)
    return n


def _prune(cache: Path, unused_days: float = UNUSED_DAYS) -> None:
    """Remove the sibling caches (other pins, other interpreters) no setup used for
    ``unused_days`` (``restore`` marks a cache used)."""
    old = time.time() - unused_days * 86400
    for other in cache.parent.iterdir():
        if other != cache and other.is_dir() and other.stat().st_mtime < old:
            shutil.rmtree(other, ignore_errors=True)


def restore(site: Path, cache: Path) -> int:
    """Link ``cache``'s bytecode into ``site`` where its source is and no bytecode is.
    Returns how many files it linked."""
    n = 0
    for pyc in _bytecode(cache):
        dst = site / pyc.relative_to(cache)
        if _source_of(dst).is_file() and not dst.exists():
            _link(pyc, dst)
            n += 1
    os.utime(cache)  # used: kept by ``_prune``
    return n


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("save", "restore"):
        print(__doc__.rsplit("Usage: ", 1)[1], file=sys.stderr, end="")
        return 2
    action, site, cache = argv[0], Path(argv[1]), Path(argv[2])
    if action == "restore":
        if not cache.is_dir():
            return 1
        return 0 if restore(site, cache) else 1
    save(site, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
