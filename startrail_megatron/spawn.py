"""Spawn gloo ranks on this machine: the entry points' ``--nproc`` mode."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["spawn_local_ranks"]


def _entry(rank, world, init_file, timeout, threads, fn, args) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _ignore(signum, frame) -> None:
    pass


def spawn_local_ranks(
    fn: Callable,
    nprocs: int,
    *args,
    timeout: timedelta,
    threads: int = 1,
    ranks_handle_sigint: bool = False,
) -> None:
    """Run the module-level ``fn(rank, nprocs, *args)`` on ``nprocs`` spawned processes.

    Each joins a gloo process group (file:// rendezvous in a temporary folder, so
    no port is needed) with ``timeout`` and destroys it afterwards. With
    ``ranks_handle_sigint`` the parent ignores Ctrl-C while it waits (the terminal sends
    SIGINT to the ranks too, and they stop cleanly themselves).
    """
    # a Python handler, not SIG_IGN: the spawned ranks (a new interpreter) start with the
    # default one, so Ctrl-C reaches them also before they install their own
    prev = signal.signal(signal.SIGINT, _ignore) if ranks_handle_sigint else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            torch.multiprocessing.start_processes(
                _entry,
                args=(nprocs, os.path.join(tmp, "rdv"), timeout, threads, fn, args),
                nprocs=nprocs,
                start_method="spawn",
            )
    finally:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
