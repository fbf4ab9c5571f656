"""Keeps the bytecode ``compile_imports.py`` wrote into a venv, for the next fresh venv.

uv links every installed file of a wheel from its cache (``~/.cache/uv``), so the site-packages
files of two venvs set up from the same pins are one file on disk, and the bytecode compiled
in one is valid in the other. ``save`` links each ``__pycache__/*.pyc`` whose source file is
such a shared file (a link count above one) into a cache folder, with a manifest of each
source file's identity (device, inode, modification time in ns, size); ``restore`` gives a new
venv's site-packages the bytecode of those modules: linked where its source is that very file,
unchanged, else compiled from the venv's source (``py_compile``, without importing: uv
unpacks DeepSpeed, built from its sdist, into new files at every setup here; its 458 modules
in 0.8 s). A setup that restored skips ``compile_imports.py`` (~19 s of a core per lane);
where a cached module's source is gone (a dependency changed release), it compiles by
importing and saves the cache anew.

Nothing stale is linked: an entry is linked only into a venv whose source is the same file
(inode) unchanged since (time, size), and Python checks the bytecode's recorded time and
size against the source on every import besides. Files uv writes itself (the editable
install's finder, which names the clone's path) are never shared and so never saved. A cache
no setup used for two weeks is removed by the next ``save``.

Usage: python bytecode_cache.py save|restore SITE_PACKAGES CACHE_FOLDER
(restore exits 1 where the setup must compile: no cache, or a cached module's source gone)
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import py_compile
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["restore", "save"]

UNUSED_DAYS = 14
# the bytecode an import writes (py_compile's default follows SOURCE_DATE_EPOCH instead)
TIMESTAMP = py_compile.PycInvalidationMode.TIMESTAMP
MANIFEST = "sources.json"  # each .pyc's path -> its source file's identity when saved


def _source_of(pyc: Path) -> Path | None:
    """``pkg/__pycache__/mod.cpython-311.pyc`` -> ``pkg/mod.py``; None for another
    interpreter's bytecode."""
    try:
        return Path(importlib.util.source_from_cache(str(pyc)))
    except ValueError:
        return None


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size]


def _compiled_from(pyc: Path, st: os.stat_result) -> bool:
    """Whether ``pyc`` is this interpreter's timestamp bytecode of a source with ``st``'s
    modification time and size (what Python itself checks on import)."""
    with open(pyc, "rb") as f:
        head = f.read(16)
    return (
        len(head) == 16
        and head[:4] == importlib.util.MAGIC_NUMBER
        and int.from_bytes(head[4:8], "little") == 0  # not hash-based
        and int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
        and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF
    )


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
    except OSError as e:  # another file system, or one without (more) links
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(src, dst)


def save(site: Path, cache: Path) -> int:
    """Put the bytecode of ``site``'s shared source files in ``cache``, in place of what it
    held (made whole, then renamed into place: a setup beside this one sees all of it or
    none). Returns how many files it holds."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
    manifest = {}
    for pyc in _bytecode(site):
        src = _source_of(pyc)
        if src is None or not src.is_file():
            continue
        st = src.stat()
        if st.st_nlink > 1 and _compiled_from(pyc, st):
            rel = str(pyc.relative_to(site))
            _link(pyc, tmp / rel)
            manifest[rel] = _identity(st)
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    old = None
    if cache.exists():
        old = cache.with_name(f"{cache.name}.old.{os.getpid()}")
        cache.rename(old)
    try:
        tmp.rename(cache)
    except OSError:  # saved by a setup beside this one meanwhile: that one stays
        shutil.rmtree(tmp)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(cache)
    return len(manifest)


def _prune(cache: Path, unused_days: float = UNUSED_DAYS) -> None:
    """Remove the sibling caches (other pins, other interpreters, saves cut short) no setup
    used for ``unused_days`` (``restore`` marks a cache used)."""
    old = time.time() - unused_days * 86400
    for other in cache.parent.iterdir():
        if other != cache and other.is_dir() and other.stat().st_mtime < old:
            shutil.rmtree(other, ignore_errors=True)


def restore(site: Path, cache: Path) -> tuple[int, int, int]:
    """Give ``site`` the bytecode of each module in ``cache`` where it has none: linked where
    the source is the very file it was compiled from, unchanged; else compiled from the
    source ``site`` has (uv unpacked it again: DeepSpeed, built from its sdist, gets new
    files at every setup). Returns (linked, compiled, entries whose source ``site`` lacks)."""
    os.utime(cache)  # used: kept by ``_prune`` (first: a save beside this one prunes)
    manifest = json.loads((cache / MANIFEST).read_text())
    linked = compiled = missing = 0
    for rel, identity in manifest.items():
        dst = site / rel
        src = _source_of(dst)
        if src is None or not src.is_file():
            missing += 1
        elif dst.exists():
            continue
        elif _identity(src.stat()) == identity:
            _link(cache / rel, dst)
            linked += 1
        else:
            py_compile.compile(str(src), str(dst), doraise=True, invalidation_mode=TIMESTAMP)
            compiled += 1
    return linked, compiled, missing


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("save", "restore"):
        print(__doc__.rsplit("Usage: ", 1)[1], file=sys.stderr, end="")
        return 2
    action, site, cache = argv[0], Path(argv[1]), Path(argv[2])
    if action == "restore":
        if not (cache / MANIFEST).is_file():
            return 1
        try:
            linked, compiled, missing = restore(site, cache)
        except (OSError, py_compile.PyCompileError) as e:  # pruned or saved anew meanwhile
            print(f"bytecode_cache.py: not restored ({e}); compiling", file=sys.stderr)
            return 1
        return 0 if linked + compiled and not missing else 1
    try:
        save(site, cache)
    except OSError as e:  # a cache folder not writable: the venv is set up all the same
        print(f"bytecode_cache.py: not saved to {cache} ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
