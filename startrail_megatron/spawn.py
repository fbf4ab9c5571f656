"""Start gloo ranks on this machine: the entry points' ``--nproc`` mode."""

from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["forks_die_with_their_parent", "spawn_local_ranks", "start_method"]


def _entry(rank, world, init_file, timeout, threads, fn, args) -> None:
    torch.set_num_threads(threads)
    # a forked rank inherits the parent's handler (``_ignore`` under ranks_handle_sigint);
    # a new interpreter starts with Python's own: the same in both
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


_PR_SET_PDEATHSIG = 1
_forking_pid: int | None = None
_registered = False


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _in_child() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _forking_pid:  # the parent died before the line above
        os._exit(1)


def forks_die_with_their_parent() -> None:
    """From now on every process forked from this one (and from those: the hooks are
    inherited) is killed when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere
    nothing). A forked helper holds copies of its parent's sockets and of its pipe to the
    launcher: while it lives, a dead rank's peers and launcher see no death, and the job
    hangs until the collective timeout. megatron-core's checkpoint writer forks a worker
    per save: a rank killed mid-save left it behind, the job hung. (Linux sends the signal
    when the forking *thread* ends: fork from the main thread, as these helpers do.)"""
    global _registered
    if _registered or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)
    _registered = True


def _ignore(signum, frame) -> None:
    pass


def start_method(threads: int) -> str:
    """How the ranks start: forked from this process on Linux when they are CPU ranks
    of one thread each (they inherit its imports: megatron-core's alone takes ~5 s of CPU
    per interpreter), else spawned as new interpreters. A forked child must not use CUDA
    (no device: ``torch.cuda.is_available()`` is false) nor more than one OpenMP thread
    (a fork copies no OpenMP pool the parent started, so a child that enters a parallel
    region with more threads can hang; with one thread torch never enters one)."""
    if sys.platform.startswith("linux") and threads == 1 and not torch.cuda.is_available():
        return "fork"
    return "spawn"


GRACE_S = 2.0
"""After one rank fails, how long the others get to end on their own, and then to end after
SIGTERM, before SIGKILL (a stopped rank ends only so): the launcher's exit bound past the
first failure is 2 x this plus one poll."""


def _state(pid: int) -> str | None:
    """The process state letter of ``/proc/PID/stat`` (``T``: stopped), None off Linux or
    once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _stopped_names(context, stopped: dict, now: float) -> str:
    """``rank R (pid P, stopped for N s)`` for each stopped rank (``stopped``: rank -> since)."""
    return ", ".join(
        f"rank {r} (pid {context.processes[r].pid}, stopped for {now - t:.0f} s)"
        for r, t in sorted(stopped.items())
    )


def _end_stopped_after_the_others(context, stopped: dict, now: float, timeout: timedelta):
    """A rank stopped after its last collective (while it exits) fails no peer: once every
    other rank has finished cleanly and it has been stopped for the collective timeout, it
    is killed and a ``RuntimeError`` names it (the launcher would wait for it forever)."""
    if not stopped or now - min(stopped.values()) <= timeout.total_seconds():
        return
    others = [p for r, p in enumerate(context.processes) if r not in stopped]
    if not all(p.exitcode == 0 for p in others):
        return
    names = _stopped_names(context, stopped, now)
    for r in stopped:
        try:
            os.kill(context.processes[r].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise RuntimeError(
        f"{names}: stopped (SIGSTOP, a debugger) after every other rank finished, past the "
        f"collective timeout ({timeout.total_seconds():g} s): killed; its own last steps "
        "(after its last collective) may not have run"
    )


def _join_naming_stopped_ranks(context, timeout: timedelta) -> None:
    """Join the ranks (``ProcessContext.join``), polling each second which ranks are stopped
    (SIGSTOP, a debugger, a frozen cgroup: state ``T`` or ``t``). A stopped rank answers no
    collective, so its peers fail after the collective ``timeout`` with the backend's own
    words ("recv timed out"), which name no rank: when the job fails while a rank is stopped
    the error raised names that rank, its pid and how long it was stopped, chained to the
    first failing rank's error. Other failures are raised as they come."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    stopped: dict[int, float] = {}
    try:
        while not context.join(timeout=1.0, grace_period=GRACE_S):
            now = time.monotonic()
            for rank, proc in enumerate(context.processes):
                if _state(proc.pid) in ("T", "t"):
                    stopped.setdefault(rank, now)
                else:
                    stopped.pop(rank, None)
            _end_stopped_after_the_others(context, stopped, now, timeout)
    except (ProcessRaisedException, ProcessExitedException) as e:
        if not stopped:
            raise
        names = _stopped_names(context, stopped, time.monotonic())
        raise RuntimeError(
            f"{names}: a stopped process (SIGSTOP, a debugger) answers no collective, so its "
            f"peers gave up after the collective timeout ({timeout.total_seconds():g} s); the "
            f"first rank to fail said: {str(e).strip().splitlines()[-1]}"
        ) from e


def spawn_local_ranks(
    fn: Callable,
    nprocs: int,
    *args,
    timeout: timedelta,
    threads: int = 1,
    ranks_handle_sigint: bool = False,
) -> None:
    """Run the module-level ``fn(rank, nprocs, *args)`` on ``nprocs`` local processes,
    forked or spawned (``start_method``).

    Each joins a gloo process group (file:// rendezvous in a temporary folder, so no
    port is needed) with ``timeout`` and destroys it afterwards. A rank that fails ends the
    others within ``2 * GRACE_S`` (SIGTERM, then SIGKILL); a rank stopped while the job
    fails is named in the error (``_join_naming_stopped_ranks``). With
    ``ranks_handle_sigint`` the parent ignores Ctrl-C while it waits (the terminal sends
    SIGINT to the ranks too, and they stop cleanly themselves). Before forking, the
    parent's objects are frozen out of the garbage collector (``gc.freeze``), and left so.
    """
    # a Python handler, not SIG_IGN: a spawned rank (a new interpreter) starts with the
    # default one, a forked one sets it first thing (``_entry``), so Ctrl-C reaches them
    # also before they install their own
    prev = signal.signal(signal.SIGINT, _ignore) if ranks_handle_sigint else None
    method = start_method(threads)
    if method == "fork":
        # The parent's objects (torch's, megatron-core's: millions) go to the collector's
        # permanent generation: a forked rank's collections neither walk them nor write
        # their headers (which copies every page they lie on into the rank), and they stay
        # there: the parent's own collections skip them too, the one at its exit among them
        # (the README's main command, 4 iterations: 7.6 -> 6.8 CPU s). What was garbage
        # before the ranks started is not collected after; an entry point ends when its
        # ranks do.
        gc.freeze()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            context = torch.multiprocessing.start_processes(
                _entry,
                args=(nprocs, os.path.join(tmp, "rdv"), timeout, threads, fn, args),
                nprocs=nprocs,
                start_method=method,
                join=False,
            )
            _join_naming_stopped_ranks(context, timeout)
    finally:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
