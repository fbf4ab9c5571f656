"""``spawn_local_ranks``, the entry points' ``--nproc`` mode: CPU ranks of one thread are
forked (they inherit the parent's imports), others spawned as new interpreters; either
way every rank joins the gloo group and starts with Python's own Ctrl-C handler."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from common import load_script

from startrail_megatron.spawn import spawn_local_ranks, start_method

fault_campaign = load_script("fault_campaign")

_PROBE = "_startrail_spawn_test_probe"  # a module only this test's parent holds


def _report(rank, world, out_dir, parents=None):
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    rec = {
        "rank": rank,
        "world": dist.get_world_size(),
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "inherited": _PROBE in sys.modules,
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        # the parent's list (forked: the same object) is out of this rank's collections
        "parents_collected": any(o is parents for o in gc.get_objects()),
    }
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump(rec, f)


def _records(tmp_path, world):
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


def test_start_method_forks_only_single_threaded_cpu_ranks():
    expect = (
        "fork" if sys.platform.startswith("linux") and not torch.cuda.is_available() else "spawn"
    )
    assert start_method(1) == expect
    assert start_method(2) == "spawn"


def test_cpu_ranks_are_forked_join_the_group_and_take_ctrl_c(tmp_path):
    sys.modules[_PROBE] = types.ModuleType(_PROBE)
    before = signal.getsignal(signal.SIGINT)
    gc.unfreeze()  # (the test harness froze the parent's objects before forking its ranks)
    parents = [object()]  # in the collector's generations, as everything made since
    assert any(o is parents for o in gc.get_objects())
    try:
        spawn_local_ranks(
            _report, 3, str(tmp_path), parents, timeout=timedelta(seconds=60),
            ranks_handle_sigint=True,
        )  # fmt: skip
    finally:
        del sys.modules[_PROBE]
    assert signal.getsignal(signal.SIGINT) is before  # the parent's handler is back
    recs = _records(tmp_path, 3)
    assert [r["rank"] for r in recs] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 6.0 and r["threads"] == 1 for r in recs)
    forked = start_method(1) == "fork"
    assert all(r["inherited"] == forked for r in recs)
    # the parent ignored Ctrl-C while it waited; every rank has Python's own handler
    assert all(r["sigint_default"] for r in recs)
    # forked: the parent's objects were frozen out of the collector first, and stay so
    assert [r["parents_collected"] for r in recs] == [not forked] * 3
    assert any(o is parents for o in gc.get_objects()) != forked


def test_ranks_of_more_threads_are_new_interpreters(tmp_path):
    sys.modules[_PROBE] = types.ModuleType(_PROBE)
    try:
        spawn_local_ranks(
            _report, 2, str(tmp_path), timeout=timedelta(seconds=120), threads=2,
            ranks_handle_sigint=True,
        )  # fmt: skip
    finally:
        del sys.modules[_PROBE]
    recs = _records(tmp_path, 2)
    assert all(r["sum"] == 3.0 and r["threads"] == 2 for r in recs)
    assert not any(r["inherited"] for r in recs)  # spawned: nothing of the parent's
    assert all(r["sigint_default"] for r in recs)


def _stop_one(rank, world):
    if rank == 1:  # stopped before the collective: it never answers
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))


def test_a_stopped_rank_is_named_when_its_peers_time_out():
    """A rank stopped (SIGSTOP) before a collective: its peer fails after the collective
    timeout with gloo's words, which name no rank; the launcher's error names the stopped
    rank and its pid, and the job ends (the stopped rank killed) within the timeout plus
    ``2 x GRACE_S`` and a few seconds, not the 30 s torch's join gives a process that
    ignores SIGTERM."""
    import time

    import pytest

    from startrail_megatron.spawn import GRACE_S

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+, stopped for \d+ s\)") as err:
        spawn_local_ranks(_stop_one, 2, timeout=timedelta(seconds=3))
    took = time.monotonic() - t0
    assert "collective timeout (3 s)" in str(err.value), err.value
    assert took < 3 + 2 * GRACE_S + 8, took


def _stop_after_the_last_collective(rank, world):
    dist.all_reduce(torch.ones(1))
    if rank == 1:  # no peer waits for it any more: no collective times out
        os.kill(os.getpid(), signal.SIGSTOP)


def test_a_rank_stopped_after_its_last_collective_is_named_not_waited_for():
    """Every other rank finishes; the stopped one fails no peer. The launcher kills it once
    it has been stopped for the collective timeout, naming it (waiting for it would hang)."""
    import time

    import pytest

    def hang(signum, frame):
        raise TimeoutError("the launcher waited for the stopped rank: a hang")

    prev = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)  # the test's own deadline
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+, stopped for \d+ s\): stopped"):
            spawn_local_ranks(_stop_after_the_last_collective, 2, timeout=timedelta(seconds=3))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, prev)
    assert time.monotonic() - t0 < 3 + 8


_FORKS = """
import os, sys, time
from startrail_megatron.spawn import forks_die_with_their_parent
forks_die_with_their_parent()
child = os.fork()
if child == 0:  # a helper that would outlive its parent, and one of its own
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(60)
        os._exit(0)
    print(grandchild, flush=True)
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def test_forked_helpers_die_with_their_parent():
    """A process forked after ``forks_die_with_their_parent`` (and one it forks in turn,
    which must not be killed at its start) is killed when its parent is SIGKILLed: a
    rank's helper never outlives it holding its sockets."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKS], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        pids = sorted(int(proc.stdout.readline()) for _ in range(2))
        time.sleep(0.3)
        assert all(_alive(p) for p in pids), pids  # the grandchild survived its own start
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), pids
    finally:
        if fault_campaign.group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    st = fault_campaign._proc_stat(pid)
    return st is not None and st[0] != "Z"
