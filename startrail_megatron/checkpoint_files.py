"""Checkpoint folders that are complete or absent: the pieces both adapters' saves share.

Note [atomic checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~
A save writes every file into ``NAME.partial``; once every rank's files are written and
synced, the ranks hash them (each rank a share of the files), rank 0 writes the list of
files with their SHA-256 (``MANIFEST``), renames the folder to ``NAME`` and then writes
the tracker (the file naming the latest checkpoint) through a temporary name and a
rename. A save killed at any point, or one that fails (a full disk), leaves the tracker
naming the last complete checkpoint; a load first checks every file against the
manifest on every rank, so a flipped byte, a truncated or a missing file is a
``ValueError`` naming the files, raised on every rank before anything is read.

Framework-free: ``megatron/training/checkpoint.py`` and ``deepspeed/checkpoint.py`` call
it with what their framework writes. Collective calls (``write_manifest``,
``verify_manifest``) go over ``torch.distributed``'s default group.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = [
    "MANIFEST",
    "check_pickle_globals",
    "commit",
    "complete_checkpoints",
    "generator_states",
    "load_rng_states",
    "naming_save_failures",
    "read_tracker",
    "refuse_lost_tracker",
    "restore_generators",
    "save_rng_states",
    "sha256",
    "verify_manifest",
    "write_durably",
    "write_manifest",
]

MANIFEST = "checksums.json"
"""A checkpoint folder's list of its files with their SHA-256 (written last, before the
folder is renamed to its final name)."""


def _rng_file(folder: str) -> str:
    return os.path.join(folder, "rng", f"rank{dist.get_rank():05d}.pt")


def generator_states() -> dict:
    """This rank's torch generators: the CPU one, and the current CUDA device's where CUDA
    is in use (a framework adds its own, e.g. megatron-core's RNG tracker)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_generators(state: dict) -> None:
    """Put back what ``generator_states`` took (other keys are the caller's)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save_rng_states(folder: str, state: dict) -> None:
    """Every rank: its generator states into ``folder/rng/rankNNNNN.pt`` (hashed with the
    rest by ``write_manifest``; a rank's draws depend on its own shapes, so each keeps its
    own). Dropout draws from them: a resume that restores them draws the masks the
    uninterrupted run would."""
    os.makedirs(os.path.join(folder, "rng"), exist_ok=True)
    torch.save(state, _rng_file(folder))


def load_rng_states(folder: str, manifest: dict, ranks: dict, setting: str) -> dict | None:
    """This rank's saved generator states, where ``manifest["rng"]`` (what the saving run
    recorded of its ranks) equals ``ranks`` (this run's): elsewhere they would be another
    rank's draws, and rank 0 says the generators start from the seed (``None``). Read
    weights-only (tensors and plain containers)."""
    saved = manifest.get("rng")
    why = None
    if saved is None:
        why = "it holds no generator states (saved by an older version)"
    elif saved != ranks:
        why = f"its generator states are of other ranks ({saved}; this run: {ranks})"
    if why is None:
        return torch.load(_rng_file(folder), map_location="cpu", weights_only=True)
    if dist.get_rank() == 0:
        print(f"note: {setting} {folder}: {why}; dropout draws start from the seed", flush=True)
    return None


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync(path: str) -> None:
    """Sync a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, text: str) -> None:
    """``text`` to ``path`` through a temporary name, synced, then renamed over it: a crash
    leaves the old content or the new one, never a truncated file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(os.path.dirname(path) or ".")


def _files(folder: str) -> list[str]:
    """The files under ``folder`` (relative paths, sorted), the manifest excluded."""
    out = []
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (each file hashed by one rank)."""
    return sorted(names)[dist.get_rank() :: dist.get_world_size()]


def write_manifest(folder: str, extra: dict | None = None) -> None:
    """Collective, after every rank's files in ``folder`` are written (a barrier before):
    every rank syncs and hashes its share, rank 0 writes ``MANIFEST`` (the files and
    ``extra``, e.g. the model's shape) durably."""
    mine = {}
    for n in _share(_files(folder)):
        fsync(os.path.join(folder, n))  # written by any rank: syncing the file is enough
        mine[n] = sha256(os.path.join(folder, n))
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    if dist.get_rank() == 0:
        content = {"files": {n: h for s in shares for n, h in s.items()}, **(extra or {})}
        write_durably(os.path.join(folder, MANIFEST), json.dumps(content, indent=0))


def read_manifest(folder: str, setting: str = "--load") -> dict:
    """The manifest of ``folder``; a ``ValueError`` naming ``setting`` when there is none
    (not a complete checkpoint) or it does not parse."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise ValueError(
            f"{setting}: {folder} has no {MANIFEST}: it is not a complete checkpoint of "
            "startrail_megatron (saved by an older version or another tool, or a save that "
            "did not finish)"
        )
    try:
        with open(path) as f:
            content = json.load(f)
        if not isinstance(content.get("files"), dict):
            raise ValueError("no 'files'")
    except ValueError as e:
        raise ValueError(f"{setting}: {path} is corrupted ({e})") from None
    return content


def verify_manifest(
    folder: str,
    manifest: dict,
    skip: Callable[[str], bool] = lambda name: False,
    setting: str = "--load",
) -> None:
    """Collective: every file ``manifest`` lists (but those ``skip`` names) against its
    SHA-256, each rank a share; a ``ValueError`` naming the files that differ or are
    missing, the same on every rank."""
    sums = manifest["files"]
    bad = []
    for n in _share([n for n in sums if not skip(n)]):
        file = os.path.join(folder, n)
        if not os.path.exists(file):
            bad.append(f"{n} (missing)")
        elif sha256(file) != sums[n]:
            bad.append(f"{n} (checksum differs)")
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, bad)
    bad = sorted(b for rank_bad in found for b in rank_bad)
    if bad:
        raise ValueError(f"{setting}: {folder} is corrupted: {', '.join(bad)}")


def commit(partial: str, final: str, tracker: str, text: str) -> None:
    """Rank 0, after ``write_manifest``: ``partial`` renamed to ``final`` (replacing an
    earlier save of the same name), then ``tracker`` written durably with ``text``."""
    fsync(partial)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync(os.path.dirname(final) or ".")
    write_durably(tracker, text)


def check_pickle_globals(path: str, allowed, setting: str) -> None:
    """Refuse a pickle file that names any global ``allowed(module, name)`` does not admit: a
    ``ValueError`` naming the file and the global, before anything of the file is called
    (the restricted unpickler raises at the first foreign global). For files that a
    framework unpickles without restriction (torch.distributed.checkpoint's ``.metadata``):
    a crafted one would run code."""

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if not allowed(module, name):
                raise ValueError(
                    f"{setting}: {path} names {module}.{name}, which such a file never holds; "
                    "it is not loaded (unpickling it could run code)"
                )
            return super().find_class(module, name)

    with open(path, "rb") as f:
        data = f.read()
    try:
        _Restricted(io.BytesIO(data)).load()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled: named, not a traceback
        raise ValueError(f"{setting}: {path} does not unpickle ({type(e).__name__}: {e})") from e


def complete_checkpoints(folder: str) -> list[str]:
    """The folders under ``folder`` holding a manifest (complete saves), sorted."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if os.path.isfile(os.path.join(folder, n, MANIFEST))]


def refuse_lost_tracker(folder: str, tracker: str, setting: str, hint: str) -> None:
    """A ``ValueError`` when ``folder`` holds complete checkpoints but not its tracker
    (deleted, or lost with a disk): starting from scratch there would be silent."""
    found = complete_checkpoints(folder)
    if found:
        raise ValueError(
            f"{setting}: {folder} holds complete checkpoints ({', '.join(found[-3:])}) but no "
            f"tracker {os.path.basename(tracker)}: it was deleted or lost; {hint}"
        )


def read_tracker(tracker: str, setting: str, check: Callable[[str], bool], expect: str) -> str:
    """The tracker's text, stripped; a ``ValueError`` naming ``setting`` and the file when
    ``check`` refuses it (an empty or garbled tracker: a tool that wrote it in place)."""
    with open(tracker) as f:
        text = f.read().strip()
    if not check(text):
        raise ValueError(
            f"{setting}: the tracker {tracker} holds {text[:40]!r}, not {expect} (a save "
            "interrupted while writing it, or edited by hand)"
        )
    return text


def _disk_full(folder: str) -> bool:
    """Whether the filesystem holding ``folder`` has (almost) no room left."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        st = os.statvfs(folder or ".")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW


FULL_BELOW = 1 << 20
"""Free bytes under which a failed write is put down to a full disk (torch.save's writer
reports one as ``RuntimeError: ... iostream error``, not ``ENOSPC``)."""


@contextlib.contextmanager
def naming_save_failures(setting: str, folder: str, tracker: str) -> Iterator[None]:
    """Turn a failed write of a checkpoint (an ``OSError``, or any error while the disk is
    full: a lost mount, no space) into a ``RuntimeError`` naming the rank, the folder, the
    error and the checkpoint a resume gets (the one ``tracker`` names, read only then; the
    unfinished folder is never taken as complete). Other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        full = _disk_full(folder)
        if not (full or isinstance(e, OSError)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        if full or getattr(e, "errno", None) == errno.ENOSPC:
            why = "the disk is full"
        else:
            why = os.strerror(e.errno) if getattr(e, "errno", None) else "a write failed"
        try:
            with open(tracker) as f:
                last = f"the checkpoint its tracker names ({f.read().strip()!r})"
        except OSError:
            last = None
        raise RuntimeError(
            f"{setting}: saving {folder} failed on rank {rank}: {why} ({type(e).__name__}: "
            f"{e}); the unfinished save stays {os.path.basename(folder)!r} and is never "
            f"loaded; a resume gets {last or 'no checkpoint (none was complete)'}"
        ) from e
