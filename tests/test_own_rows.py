"""The first step's own query rows first: exact, it ran, and its default.

``CommOptions(own_rows_first=True)`` splits the first computed step's kernel calls by query
rows (``schedule.split_own_rows``): the rank's own rows run while the team's queries
(forward) and output gradients (backward) are gathered, then the other rows. The outputs
and all gradients match float64 attention (1e-10) on several layouts, causal, full and
windowed; each rank's count of kernel calls equals the split plan's, which is larger than
the unsplit plan's (so the split ran), and with ``False`` it equals the unsplit plan's.
The default (``None``) splits only where the rank's team spans hosts and the gather carries
more bytes than the placement (``own_rows_first_pays``): checked with faked host names.
The order of waits and calls is checked in ``test_overlap.py``.
"""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch
from common import (
    TOL,
    assert_matches_reference,
    groups_for,
    make_inputs,
    own_rows_first_env,
    reference,
    shard,
)
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.comm import CommOptions
from startrail_megatron.kernels import TorchKernel
from startrail_megatron.one_process import RankTimer, one_process_attention
from startrail_megatron.schedule import (
    normalize_window,
    own_rows_first_pays,
    own_team_rows,
    split_own_rows,
    startrail_active_steps,
    startrail_step_rows,
    startrail_step_window_rows,
    tail_head_groups,
)
from startrail_megatron.validation import OWN_ROWS_FIRST_ENV

S_LOCAL, BATCH, D = 4, 2, 8


class _Counting(TorchKernel):
    """The reference kernel, counting its forward and backward calls, and those that read
    the rank's own q (forward) or dout (backward) tensors, not the gathered team's."""

    def __init__(self, q_local, do_local):
        super().__init__()
        self.mine = {"fwd": _ptr(q_local), "bwd": _ptr(do_local)}
        self.calls = {"fwd": 0, "bwd": 0, "fwd_own": 0, "bwd_own": 0}

    def forward(self, q, *a, **kw):
        self.calls["fwd"] += 1
        self.calls["fwd_own"] += _ptr(q) == self.mine["fwd"]
        return super().forward(q, *a, **kw)

    def backward(self, do, *a, **kw):
        self.calls["bwd"] += 1
        self.calls["bwd_own"] += _ptr(do) == self.mine["bwd"]
        return super().backward(do, *a, **kw)


def _ptr(x):
    return x.untyped_storage().data_ptr()


def _expected_calls(lay, r, causal, window, hq, hkv, split):
    """Kernel calls of rank r in one forward (the backward makes the same), and how many
    of them are on its own rows: the computed steps' calls, the first step split where
    ``split``, the last step's once per head group (the own rows' calls, made before the
    groups, once)."""
    band = None if window is None else normalize_window(window, lay.cp_size * S_LOCAL, causal)
    steps = lay.computed_steps(r, startrail_active_steps(lay, causal, S_LOCAL, band, None))
    groups = len(tail_head_groups(lay, hq, hkv, False))
    n = mine = 0
    for i, step in enumerate(steps):
        if band is None:
            calls = startrail_step_rows(lay, r, step, causal, S_LOCAL)
        else:
            calls = startrail_step_window_rows(lay, r, step, causal, S_LOCAL, band)
        own = ()
        if i == 0 and split:
            own, calls = split_own_rows(calls, own_team_rows(lay, r, causal, S_LOCAL))
        n += len(own) + len(calls) * (groups if i == len(steps) - 1 else 1)
        mine = mine if i else len(own)
    return {"fwd": n, "bwd": n, "fwd_own": mine, "bwd_own": mine}


def _run(rank, world, groups, causal, hq, hkv, window, orf, softcap=None):
    q, k, v, do = make_inputs(0, S_LOCAL * world, BATCH, hq, hkv, D)
    zig = causal or window is not None  # windows take the zigzag layout, causal or not
    local = [shard(x, rank, world, zig).to(torch.float64).requires_grad_() for x in (q, k, v)]
    do_local = shard(do, rank, world, zig).to(torch.float64).contiguous()
    kern = _Counting(local[0], do_local)
    out = st.startrail_attention(
        *local, groups, causal=causal, kernel=kern, window=window, softcap=softcap,
        comm_options=CommOptions(own_rows_first=orf),
    )  # fmt: skip
    out.backward(do_local)
    return [out.detach(), *(x.grad for x in local)], kern.calls


def _case(rank, world, c, placement, causal, hq, hkv, window, cap):
    groups = groups_for(c, placement)
    return [_run(rank, world, groups, causal, hq, hkv, window, orf, cap) for orf in (True, False)]


CASES = [
    pytest.param(4, 2, "team", True, (8, 2), None, None, id="P4-C2-G1-causal-gqa"),
    pytest.param(4, 2, "team", False, (4, 4), None, None, id="P4-C2-G1-full"),
    pytest.param(8, 2, "team", True, (4, 4), None, None, id="P8-C2-team-causal"),
    pytest.param(8, 2, "ring", True, (8, 2), None, None, id="P8-C2-ring-causal-gqa"),
    pytest.param(8, 2, "ring", False, (4, 2), None, None, id="P8-C2-ring-full"),
    pytest.param(8, 2, "team", True, (4, 2), (5, 0), None, id="P8-C2-window"),
    pytest.param(8, 2, "ring", True, (4, 2), (5, 0), 2.0, id="P8-C2-ring-window-softcap"),
    pytest.param(8, 2, "team", False, (4, 2), (3, 2), None, id="P8-C2-full-window"),
    pytest.param(9, 3, "ring", True, (6, 3), None, None, id="P9-C3-causal"),
]


@pytest.mark.parametrize("p,c,placement,causal,heads,window,cap", CASES)
def test_own_rows_first_matches_fp64_and_ran(p, c, placement, causal, heads, window, cap):
    hq, hkv = heads
    res = run_ranks(p, _case, c, placement, causal, hq, hkv, window, cap)
    q, k, v, do = make_inputs(0, S_LOCAL * p, BATCH, hq, hkv, D)
    ref = reference(q, k, v, do, causal, window=window, softcap=cap)
    lay = st.StarTrailLayout(p, c, placement)
    for on_off, split in ((0, True), (1, False)):
        runs = [r[on_off] for r in res]
        zig = causal or window is not None
        assert_matches_reference(runs, ref, zig, torch.float64, TOL[torch.float64])
        for r, (_, calls) in enumerate(runs):
            want = _expected_calls(lay, r, causal, window, hq, hkv, split)
            assert calls == want, (r, split, calls, want)
            if not split:  # no call reads the rank's own q or dout without the split
                assert calls["fwd_own"] == calls["bwd_own"] == 0, (r, calls)
        # with it, the ranks' own rows ran first (under a narrow window a rank's own rows
        # may see nothing of the first step's K,V: the plan above says where)
        own = [r[1]["fwd_own"] > 0 and r[1]["bwd_own"] > 0 for r in runs]
        assert any(own) == split and (all(own) or not split or window is not None), own


def _hosts_case(rank, world, c, hq, hkv):
    """Groups created with faked host names (two ranks per host), then one default call."""
    real = socket.gethostname
    socket.gethostname = lambda: f"host{rank // 2}"
    try:
        spread = st.StarTrailGroups.create(c, placement="ring")  # teams: ranks r, r + 4
        packed = st.StarTrailGroups.create(c, placement="team")  # teams: ranks 2t, 2t + 1
    finally:
        socket.gethostname = real
    return [
        (g.team_hosts, _run(rank, world, g, True, hq, hkv, None, None)[1]) for g in (spread, packed)
    ]


@pytest.mark.parametrize("heads", [(8, 1), (4, 4)], ids=["mqa", "mha"])
def test_default_splits_where_the_team_spans_hosts_and_the_gather_is_larger(heads):
    hq, hkv = heads
    p, c = 8, 2
    res = run_ranks(p, _hosts_case, c, hq, hkv)
    for placement, i in (("ring", 0), ("team", 1)):
        lay = st.StarTrailLayout(p, c, placement)
        for r, per_groups in enumerate(res):
            hosts, calls = per_groups[i]
            assert hosts == (2 if placement == "ring" else 1), (placement, r, hosts)
            split = own_rows_first_pays(lay, hq, hkv, hosts)
            assert split == (placement == "ring" and hq > 4 * hkv)
            assert calls == _expected_calls(lay, r, True, None, hq, hkv, split), (placement, r)


def test_own_rows_first_rule():
    lay = st.StarTrailLayout
    assert not own_rows_first_pays(lay(8, 1), 32, 1, 2)  # no team
    assert not own_rows_first_pays(lay(8, 2), 32, 1, 1)  # the team inside one host
    assert own_rows_first_pays(lay(8, 2), 32, 4, 2)  # (C-1) hq = 32 > 2 C hkv = 16
    assert not own_rows_first_pays(lay(8, 2), 32, 8, 2)  # 32 = 32: the placement ends last
    assert own_rows_first_pays(lay(16, 4), 32, 8, 3)  # 96 > 64
    assert not own_rows_first_pays(lay(16, 4), 32, 32, 4)
    with pytest.raises(ValueError, match="own_rows_first"):
        CommOptions(own_rows_first=1)


def _env_case(rank, world, value, on_groups=None, orf=None):
    """One call under ``$STARTRAIL_OWN_ROWS_FIRST=value``, on groups whose own setting is
    ``on_groups`` (``StarTrailGroups.own_rows_first``: the adapters' flag or key), with
    ``CommOptions(own_rows_first=orf)``."""
    try:
        groups = groups_for(2, key=on_groups)
        if on_groups is not None:
            groups = dataclasses.replace(groups, own_rows_first=on_groups)
        with own_rows_first_env(value):
            return _run(rank, world, groups, True, 8, 2, None, orf)[1]
    except ValueError as e:
        return str(e)


def test_environment_variable_sets_the_default():
    """``$STARTRAIL_OWN_ROWS_FIRST`` is what the adapters' default calls use: ``on``
    splits on one host, ``off`` and ``auto`` keep the step whole there; any other value
    is refused by name on every rank before a transfer (no rank hangs)."""
    lay = st.StarTrailLayout(4, 2)
    for value, split in (("on", True), ("off", False), ("auto", False), (" ON ", True)):
        for r, calls in enumerate(run_ranks(4, _env_case, value)):
            assert calls == _expected_calls(lay, r, True, None, 8, 2, split), (value, r)
    for msg in run_ranks(4, _env_case, "maybe"):
        assert OWN_ROWS_FIRST_ENV in msg and "'auto', 'on', 'off'" in msg, msg


def test_call_then_groups_then_environment():
    """Who decides, first to last: the call's ``CommOptions(own_rows_first=)``, the groups'
    setting (Megatron's flag, DeepSpeed's key), ``$STARTRAIL_OWN_ROWS_FIRST``, the rule."""
    lay = st.StarTrailLayout(4, 2)
    cases = [  # (environment, groups, call) -> split
        (("off", True, None), True),
        (("on", False, None), False),
        (("on", False, True), True),
        (("off", True, False), False),
        (("on", None, False), False),
    ]
    for (env, on_groups, orf), split in cases:
        for r, calls in enumerate(run_ranks(4, _env_case, env, on_groups, orf)):
            assert calls == _expected_calls(lay, r, True, None, 8, 2, split), (env, on_groups, r)
    with pytest.raises(ValueError, match=r"own_rows_first='on' must be True, False or None"):
        st.StarTrailGroups.create(2, own_rows_first="on")  # before any communication


def test_one_process_mode_runs_own_rows_first_and_reports_the_gather_hidden():
    """``one_process_attention(own_rows_first=True)``: bitwise equal to the forced split on
    gloo ranks' math (checked against float64 here), and the one-process timer shows the
    q gather (and the backward's dout) in flight while the own rows' calls ran."""
    p, c, hq, hkv = 4, 2, 8, 2
    q, k, v, do = make_inputs(0, S_LOCAL * p, BATCH, hq, hkv, D)
    ref = reference(q, k, v, do, True)
    for orf in (True, False):
        shards = [[shard(x, r, p, True).requires_grad_() for r in range(p)] for x in (q, k, v)]
        timer = RankTimer(p)
        outs = one_process_attention(*shards, c, kernel=_Slow(), timer=timer, own_rows_first=orf)
        torch.autograd.backward(outs, [shard(do, r, p, True) for r in range(p)])
        got = [[outs[r].detach(), *(x[r].grad for x in shards)] for r in range(p)]
        assert_matches_reference([(g, None) for g in got], ref, True, torch.float64, 1e-10)
        rows = timer.overlap(link_bytes_per_s=1e12)
        for r in range(p):
            for key in ("fwd/collective/q_team", "bwd/collective/dout"):
                window = rows[r][key]["window_s"]  # a kernel call takes >= 5 ms
                assert (window >= 0.005) == orf, (orf, r, key, window)  # calls ran meanwhile


class _Slow(TorchKernel):
    """The reference kernel, 5 ms per call: the timer's windows then show kernel calls."""

    def forward(self, *a, **kw):
        time.sleep(0.005)
        return super().forward(*a, **kw)

    def backward(self, *a, **kw):
        time.sleep(0.005)
        return super().backward(*a, **kw)
