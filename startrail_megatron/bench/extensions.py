"""The folder where DeepSpeed's ops are built on first use (``TORCH_EXTENSIONS_DIR``).

DeepSpeed builds an op the first time a rank needs it (on CPU ranks its shared-memory
collectives, ~35 s on 2 cores). A build killed midway leaves ``lock`` in the op's folder
and every later build there waits on it forever, without a word; a folder shared by two
interpreters or torch releases rebuilds the op for each in turn. So the benchmark (and
the test suite) build in a folder of their own, one per Python and torch release, kept
between runs, and remove a lock no build has touched for ``STALE_LOCK_S``.
"""

from __future__ import annotations

import os
import sys
import time

import torch

__all__ = ["STALE_LOCK_S", "extensions_dir", "remove_stale_locks"]

STALE_LOCK_S = 900.0
"""A lock this old is a killed build's: a live one finishes in well under a minute."""


def extensions_dir(env, kind: str = "bench") -> str:
    """``<cache>/startrail_megatron/<kind>_torch_extensions/py<X.Y>-torch<version>``:
    ``<cache>`` is ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    release = f"py{sys.version_info[0]}.{sys.version_info[1]}-torch{torch.__version__}"
    return os.path.join(cache, "startrail_megatron", f"{kind}_torch_extensions", release)


def remove_stale_locks(folder: str, older_than_s: float = STALE_LOCK_S) -> list[str]:
    """Remove every op's ``lock`` in ``folder`` last touched ``older_than_s`` ago or more;
    the paths removed."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    now = time.time()
    for op in sorted(os.listdir(folder)):
        lock = os.path.join(folder, op, "lock")
        try:
            if now - os.path.getmtime(lock) >= older_than_s:
                os.remove(lock)
                removed.append(lock)
        except (FileNotFoundError, NotADirectoryError):  # no lock; a file, not an op's folder
            continue
    return removed
