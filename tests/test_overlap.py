"""Overlap in the code: transfers start early and are waited on only where needed.

The order of starts, waits and kernel calls of one rank's forward and backward is
recorded through the communication seam and matched against the schedule of
``attention.py``'s Note [overlap]; with ``CommOptions(overlap=False)`` (every transfer
waited on as it starts) the same patterns fail, so the check can fail. Injected delays
show the sub-ring transfers hidden behind compute (the ledger's waits) on gloo ranks,
and the one-process mode reports each transfer's window.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from common import TOL, assert_matches_reference, groups_for, make_inputs, reference, shard
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.comm import CommOptions, DoneHandle, P2PComm, TeamComm
from startrail_megatron.comm.overlap import start_transfer
from startrail_megatron.kernels import resolve_kernel
from startrail_megatron.one_process import RankTimer, one_process_attention
from startrail_megatron.rank import RankCall, startrail_rank_backward, startrail_rank_forward

S_LOCAL, BATCH, HQ, HKV, D = 4, 1, 2, 2, 8


class _Log:
    def __init__(self):
        self.events: list[str] = []


class _RecHandle:
    """Logs where the transport really waits: at the schedule's ``wait()``, or at once
    when the transport handed back a transfer it had already waited on (``DoneHandle``:
    ``CommOptions(overlap=False)``)."""

    def __init__(self, inner, log, what):
        self.inner, self.log, self.what = inner, log, what
        log.events.append(f"start:{what}")
        self.waited = isinstance(inner, DoneHandle)
        if self.waited:
            log.events.append(f"wait:{what}")

    def wait(self):
        out = self.inner.wait()
        if not self.waited:
            self.log.events.append(f"wait:{self.what}")
        return out


class _RecTeam:
    def __init__(self, inner, log):
        self.inner, self.log, self.size = inner, log, inner.size

    def all_gather_start(self, x, what):
        h = self.inner.all_gather_start(x, what)
        return h if self.size == 1 else _RecHandle(h, self.log, what)

    def reduce_scatter_start(self, x, what):
        h = self.inner.reduce_scatter_start(x, what)
        return h if self.size == 1 else _RecHandle(h, self.log, what)

    def all_gather(self, x, what):
        return self.all_gather_start(x, what).wait()

    def reduce_scatter(self, x, what):
        return self.reduce_scatter_start(x, what).wait()


class _RecP2P:
    def __init__(self, inner, log):
        self.inner, self.log, self.cp_rank = inner, log, inner.cp_rank

    def exchange(self, send, dst, src, what, group=None, out=None):
        return _RecHandle(self.inner.exchange(send, dst, src, what, group, out), self.log, what)

    def exchange_many(self, sends, srcs, like, what, out=None):
        return _RecHandle(self.inner.exchange_many(sends, srcs, like, what, out), self.log, what)


class _RecKernel:
    """A kernel that logs each call (and can take its time: ``sleep_s``)."""

    def __init__(self, inner, log, sleep_s=0.0):
        self.inner, self.log, self.sleep_s = inner, log, sleep_s
        self.name = inner.name

    def forward(self, *a, **kw):
        self.log.events.append("K")
        time.sleep(self.sleep_s)
        return self.inner.forward(*a, **kw)

    def backward(self, *a, **kw):
        self.log.events.append("K")
        time.sleep(self.sleep_s)
        return self.inner.backward(*a, **kw)


def _run_rank(rank, world, c, overlap, delay_s=0.0, sleep_s=0.0, causal=True, split=True):
    """One rank's forward and backward through recording comm objects: (outputs, the
    forward's and the backward's event strings, the ledger's waits). ``split=False``:
    ``CommOptions(own_rows_first=False)``, the first step's calls kept whole."""
    p = world
    groups = groups_for(c)
    q, k, v, do = make_inputs(0, S_LOCAL * p, BATCH, HQ, HKV, D)
    local = [shard(x, rank, p, causal).to(torch.float64) for x in (q, k, v, do)]
    log, ledger = _Log(), st.CommLedger()
    opts = CommOptions(overlap=overlap, delay_s=delay_s, own_rows_first=split)
    comms = (
        _RecTeam(TeamComm(groups.team_group, c, ledger, opts), log),
        _RecP2P(P2PComm(groups.cp_group, rank, ledger, opts), log),
    )
    rc = RankCall(
        layout=groups.layout, rank=rank, causal=causal, team_comm=comms[0], p2p=comms[1],
        subring_group=groups.subring_group, own_rows_first=opts.own_rows_first,
        team_hosts=groups.team_hosts,
    )  # fmt: skip
    kern, scale = resolve_kernel(local[0], "torch", None)
    kernel = _RecKernel(kern, log, sleep_s)
    out, saved = startrail_rank_forward(*local[:3], rc, scale, kernel)
    fwd = " ".join(log.events)
    log.events.clear()
    ledger.phase = "bwd"
    grads = startrail_rank_backward(local[3], out, saved, rc, scale, kernel)
    dq, dk, dv = grads.dq, grads.dk, grads.dv
    bwd = " ".join(log.events)
    return [out, dq, dk, dv], fwd, bwd, ledger.waits()


def _runs(s: str) -> str:
    """Kernel calls in a row as one ``K+``."""
    return re.sub(r"K( K)*", "K+", s)


# The schedule of Note [overlap] for G = 2 sub-ring steps (C = 2 on 8 ranks): what is
# started before each wait. ``(K+ )?``: a causal step may hold no call on some rank.
FWD_C2 = (
    # the first step's calls on the rank's own query rows run while the team's queries
    # are gathered (``schedule.split_own_rows``); the other rows after the wait
    r"start:kv_place start:q_team wait:kv_place "
    r"start:kv K\+ wait:q_team (K\+ )?wait:kv "
    # the last step by head groups: group 0's lse travels while group 1 computes, group
    # 0's out while group 1's lse travels
    r"(K\+ )?start:lse (K\+ )?start:lse wait:lse start:out wait:lse start:out wait:out wait:out"
)
BWD_C2 = (
    r"start:dout start:delta start:kv_place wait:kv_place "
    r"start:kv K\+ wait:dout wait:delta (K\+ )?start:dkv wait:kv "
    # the last step by head groups: group 0's dq travels while group 1 computes; the
    # dK/dV partial sum is waited on after both (``StepDkvSum`` keeps their gradients until
    # then); the last group's dq travels beside the dK/dV parts going home
    r"K\+ start:dq K\+ wait:dkv start:dkv_home start:dq wait:dkv_home wait:dq wait:dq"
)
# Ring (C = 1 on 4 ranks, G = 4): no team collectives; KV and dK/dV one step apart.
FWD_C1 = r"start:kv_place wait:kv_place" + r" start:kv (K\+ )?wait:kv" * 3 + r"( K\+)?"
BWD_C1 = (
    r"start:kv_place wait:kv_place start:kv (K\+ )?start:dkv wait:kv"
    + r" start:kv K\+ wait:dkv start:dkv wait:kv" * 2
    + r" K\+ wait:dkv start:dkv_home wait:dkv_home"
)


# C = 2 on 4 ranks: G = 1, one step, no head groups; only the own rows hide the gathers.
FWD_G1 = r"start:kv_place start:q_team wait:kv_place K\+ wait:q_team K\+ start:lse wait:lse start:out wait:out"
BWD_G1 = (
    r"start:dout start:delta start:kv_place wait:kv_place K\+ wait:dout wait:delta K\+ "
    r"start:dkv_home start:dq wait:dkv_home wait:dq"
)


@pytest.mark.parametrize(
    "world,c,fwd,bwd", [(8, 2, FWD_C2, BWD_C2), (4, 2, FWD_G1, BWD_G1), (4, 1, FWD_C1, BWD_C1)]
)
def test_waits_come_after_the_compute_that_does_not_need_them(world, c, fwd, bwd):
    res = run_ranks(world, _run_rank, c, True)
    q, k, v, do = make_inputs(0, S_LOCAL * world, BATCH, HQ, HKV, D)
    assert_matches_reference(
        [(r[0], None) for r in res], reference(q, k, v, do, True), True, torch.float64,
        TOL[torch.float64],
    )  # fmt: skip
    for r, (_, f, b, _) in enumerate(res):
        assert re.fullmatch(fwd, _runs(f)), (r, _runs(f))
        assert re.fullmatch(bwd, _runs(b)), (r, _runs(b))
    if (
        world > c * c > 1
    ):  # G > 1: the second head group computes while the first one's lse (dq) travels
        assert any("start:lse K+ start:lse" in _runs(f) for _, f, _, _ in res)
        assert any("start:dq K+" in _runs(b) for _, _, b, _ in res)
    if c > 1:  # without the own rows first, the gathers are waited on before any call
        plain = run_ranks(world, _run_rank, c, True, 0.0, 0.0, True, False)
        for r, (outs, f, b, _) in enumerate(plain):
            assert "K" not in f.split("wait:q_team")[0] and "K" not in b.split("wait:delta")[0], r
            assert not re.fullmatch(fwd, _runs(f)) and not re.fullmatch(bwd, _runs(b)), r
            for x, y in zip(outs, res[r][0]):
                torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    # Switched off (every transfer waited on as it starts), the same schedule fails the
    # patterns, and the results are bitwise the same.
    off = run_ranks(world, _run_rank, c, False)
    for r, (outs, f, b, _) in enumerate(off):
        assert not re.fullmatch(fwd, _runs(f)) and not re.fullmatch(bwd, _runs(b)), r
        for x, y in zip(outs, res[r][0]):
            assert torch.equal(x, y)


def test_injected_delay_is_hidden_behind_sub_ring_compute():
    """Ring on 4 ranks (full attention: one kernel call per rank and step), every transfer
    slowed to 40 ms and every kernel call to 60 ms: the sub-ring KV (3 transfers forward)
    is hidden when overlapped, and exposed in full when every transfer is waited on as it
    starts."""
    delay = 0.04
    on = run_ranks(4, _run_rank, 1, True, delay, 0.06, False)
    off = run_ranks(4, _run_rank, 1, False, delay, 0.06, False)
    for r in range(4):
        w_on, w_off = on[r][3]["fwd/p2p/kv"], off[r][3]["fwd/p2p/kv"]
        assert w_on["count"] == w_off["count"] == 3
        assert w_on["exposed_s"] < delay, (r, w_on)  # less than one of the three delays
        assert w_on["hidden"] > 0.5, (r, w_on)
        assert w_off["exposed_s"] >= 3 * delay * 0.95, (r, w_off)
        assert w_off["hidden"] < 0.05, (r, w_off)
        for x, y in zip(on[r][0], off[r][0]):
            assert torch.equal(x, y)


def test_one_process_reports_each_transfers_window():
    p, c = 8, 2
    q, k, v, _ = make_inputs(0, S_LOCAL * p, BATCH, HQ, HKV, D)
    shards = [[shard(x, r, p, True).requires_grad_() for r in range(p)] for x in (q, k, v)]
    log = _Log()
    kern, _ = resolve_kernel(shards[0][0], "torch", None)
    timer, ledgers = RankTimer(p), [st.CommLedger() for _ in range(p)]
    outs = one_process_attention(
        *shards, c, kernel=_RecKernel(kern, log, 0.002), timer=timer, ledgers=ledgers
    )
    sum(o.sum() for o in outs).backward()
    fast = timer.overlap(link_bytes_per_s=1e12)
    slow = timer.overlap(link_bytes_per_s=1.0)
    for r in range(p):
        kv = fast[r]["fwd/p2p/kv"]
        assert kv["count"] == ledgers[r].calls("p2p", "fwd", "kv") == 1  # one sub-ring step
        assert kv["window_s"] >= 0.002  # the step's kernel calls ran while it was in flight
        assert fast[r]["bwd/p2p/dkv"]["window_s"] > 0
        assert fast[r]["bwd/collective/dq"]["count"] == 2  # per head group of the last step
        assert fast[r]["bwd/collective/dq"]["window_s"] >= 0.002  # group 2's calls meanwhile
        assert all(0 <= row["hidden"] <= 1 for row in fast[r].values())
        assert slow[r]["fwd/p2p/kv"]["hidden"] < fast[r]["fwd/p2p/kv"]["hidden"]
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        timer.overlap(0)


def test_comm_options_checked():
    for bad in (-1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="delay_s"):
            CommOptions(delay_s=bad)
    with pytest.raises(ValueError, match="overlap"):
        CommOptions(overlap=1)
    with pytest.raises(ValueError, match="own_rows_first"):
        CommOptions(own_rows_first="yes")
    for bad in (-1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match="delay_s_per_mib"):
            CommOptions(delay_s_per_mib=bad)
    # the delay a transfer gets: the fixed part plus the per-MiB part of what it moves
    assert CommOptions(delay_s=0.01, delay_s_per_mib=0.5).delay_for(3 * 2**19) == 0.76

    class _H:
        def wait(self):
            return 1

    with pytest.raises(ValueError, match="delay_s"):
        start_transfer(_H(), None, "p2p", "kv", CommOptions(delay_s=0.1), host_waits=False)
    with pytest.raises(ValueError, match="comm_options"):
        st.attention.check_comm_options("fast", torch.zeros(1))


def _per_mib_rank(rank, world):
    """Each rank: one P2P exchange of 1 MiB with its neighbour and one all-gather of
    0.5 MiB over both ranks, each delayed 80 ms per MiB it moves (``delay_s_per_mib``):
    the delay each handle was given, and the ledger's time of each, from issue to the end
    of its wait."""
    from startrail_megatron.comm import overlap

    ledger = st.CommLedger()
    opts = CommOptions(delay_s_per_mib=0.08)
    p2p = P2PComm(None, rank, ledger, opts)
    team = TeamComm(None, world, ledger, opts)
    x = torch.zeros(2**18)  # 1 MiB of float32
    given, init = {}, overlap.TimedHandle.__init__

    def timed(self, inner, ledger, kind, what, options, moved=0):
        init(self, inner, ledger, kind, what, options, moved)
        given[what] = self._delay

    overlap.TimedHandle.__init__ = timed
    try:
        p2p.exchange(x, 1 - rank, 1 - rank, "kv").wait()
        team.all_gather_start(x[: 2**17], "q_team").wait()  # receives (C - 1) x 0.5 MiB
    finally:
        overlap.TimedHandle.__init__ = init
    waits = {k: w["in_flight_s"] + w["exposed_s"] for k, w in ledger.waits().items()}
    return given, waits


def test_delay_per_mib_follows_the_bytes_moved():
    """The delay follows what each transfer moves (1 MiB: 80 ms; 0.5 MiB: 40 ms), and each
    wait lasts at least its delay (the upper bound is loose: the ranks share 2 cores)."""
    for r, (given, waits) in enumerate(run_ranks(2, _per_mib_rank)):
        assert given == {"kv": pytest.approx(0.08), "q_team": pytest.approx(0.04)}, (r, given)
        assert 0.08 <= waits["fwd/p2p/kv"] < 0.08 + 0.5, (r, waits)
        assert 0.04 <= waits["fwd/collective/q_team"] < 0.04 + 0.5, (r, waits)
