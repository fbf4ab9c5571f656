"""Misuse ends in a clear error, never a hang or a wrong answer.

Bad arguments raise ``ValueError`` locally before anything is sent; CP ranks that
disagree on a call's setting all raise the same ``ValueError`` (one agreement check
per new setting); a peer that dies mid-exchange makes the others fail with an error
naming the operation, the group and the peer, within a bounded time.
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import pytest
import torch
from common import TOL, groups_for, make_inputs, reference, rel_err, shard, unshard, value_errors
from harness import MultiRankError, run_ranks

import startrail_megatron as st

D = 16


def _bad_arguments(rank, world):
    groups = groups_for(2, "team")
    ledger = st.CommLedger()
    ok = torch.randn(4, 2, 4, D, dtype=torch.float64)

    def call(q=ok, k=ok, v=ok, **kw):
        return lambda: st.startrail_attention(q, k, v, groups, ledger=ledger, **kw)

    cases = {
        "int": call(ok.long(), ok.long(), ok.long()),
        "scale0": call(softmax_scale=0.0),
        "scale_neg": call(softmax_scale=-0.25),
        "scale_nan": call(softmax_scale=math.nan),
        "scale_inf": call(softmax_scale=math.inf),
        "scale_str": call(softmax_scale="0.1"),
        "len": call(k=ok[:2], v=ok[:2]),
        "batch": call(k=ok[:, :1], v=ok[:, :1]),
        "head_dim": call(k=ok[..., :8], v=ok[..., :8]),
        "kv": call(v=ok[..., :8]),
        "c_gt_p": lambda: st.StarTrailGroups.create(8),
        "c_float": lambda: st.StarTrailGroups.create(2.0),
        "c_bool": lambda: st.StarTrailGroups.create(True),
    }
    msgs = value_errors(cases)
    assert not ledger.events, "nothing may be sent before validation"
    st.startrail_attention(ok, ok, ok, groups, ledger=ledger)  # the ranks still agree
    return msgs


def test_bad_arguments_raise_before_communication():
    want = {
        "int": "must be a floating-point tensor",
        "scale0": "softmax_scale=0.0 must be a finite number > 0",
        "scale_neg": "softmax_scale=-0.25 must be",
        "scale_nan": "softmax_scale=nan must be",
        "scale_inf": "softmax_scale=inf must be",
        "scale_str": "softmax_scale='0.1' must be",
        "len": "must agree on s_local, batch and head_dim",
        "batch": "must agree on s_local, batch and head_dim",
        "head_dim": "must agree on s_local, batch and head_dim",
        "kv": "k and v shapes differ",
        "c_gt_p": "team_size=8 does not fit context-parallel size 4",
        "c_float": "team_size must be an integer >= 1, got 2.0",
        "c_bool": "team_size must be an integer >= 1, got True",
    }
    for msgs in run_ranks(4, _bad_arguments):
        for name, text in want.items():
            assert msgs[name] is not None and text in msgs[name], (name, msgs[name])


def _disagree(rank, world, what):
    """Rank 0 calls with another setting than ranks 1-3; every rank must raise, none hang."""
    groups = st.StarTrailGroups.create(2)  # fresh: no setting checked yet
    s, dtype, causal, scale = 4, torch.float64, True, None
    if rank == 0:
        if what == "s_local":
            s = 6
        elif what == "dtype":
            dtype = torch.float32
        elif what == "causal":
            causal = False
        elif what == "softmax_scale":  # partials at two scales would merge, silently wrong
            scale = 0.5
    x = torch.randn(s, 2, 4, D, dtype=dtype)
    ledger = st.CommLedger()
    try:
        st.startrail_attention(x, x, x, groups, causal=causal, softmax_scale=scale, ledger=ledger)
        return None, len(ledger.events)
    except ValueError as e:
        return str(e), len(ledger.events)


@pytest.mark.parametrize(
    "what, text",
    [
        ("s_local", "s_local (4 to 6)"),
        ("dtype", "dtype (0 to 1)"),
        ("causal", "causal (0 to 1)"),
        ("softmax_scale", "softmax_scale (float64 bits)"),
    ],
)
def test_ranks_that_disagree_all_raise(what, text):
    t0 = time.monotonic()
    for msg, sent in run_ranks(4, _disagree, what, timeout=60):
        assert msg is not None and f"disagree on {text}" in msg, msg
        assert sent == 0
    assert time.monotonic() - t0 < 30


def _changes_setting_later(rank, world):
    """The documented gap: ranks 1-3 reuse a setting they checked, rank 0 changes its own.
    Not caught by the agreement check; the transfers then fail at the groups' timeout,
    naming the group."""
    groups = st.StarTrailGroups.create(2, timeout=timedelta(seconds=2))
    x = torch.randn(4, 2, 4, D, dtype=torch.float64)
    st.startrail_attention(x, x, x, groups)
    if rank == 0:
        x = torch.randn(6, 2, 4, D, dtype=torch.float64)
    st.startrail_attention(x, x, x, groups)


def test_a_later_change_of_setting_ends_at_the_timeout_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(MultiRankError) as err:
        run_ranks(4, _changes_setting_later, timeout=30)
    assert "a peer died or did not answer within the group's timeout" in str(err.value)
    assert time.monotonic() - t0 < 30


def _timeouts(rank, world):
    from startrail_megatron.groups import group_timeout

    groups = st.StarTrailGroups.create(2)
    return group_timeout(None), group_timeout(groups.team_group)


def test_groups_inherit_the_cp_group_timeout_not_torchs_30_minutes():
    for world_t, team_t in run_ranks(4, _timeouts):
        assert world_t is not None and world_t < timedelta(minutes=5)  # the pool's, not 30 min
        assert team_t == world_t


def _disagree_on_groups(rank, world):
    try:
        st.StarTrailGroups.create(2, placement="ring" if rank == 3 else "team")
    except ValueError as e:
        return str(e)
    return None


def test_ranks_that_disagree_on_the_team_setting_all_raise():
    for msg in run_ranks(4, _disagree_on_groups, timeout=60):
        assert msg is not None and "disagree on StarTrail's (team_size, placement)" in msg, msg
        assert "(2, 'ring')" in msg and "(2, 'team')" in msg


class _DieOnRank:
    """A kernel that ends process ``rank`` at its ``nth`` call: a peer dying mid-schedule."""

    name = "die"

    def __init__(self, rank: int, me: int, nth: int):
        from startrail_megatron.kernels import TorchKernel

        self.inner, self.rank, self.me, self.nth, self.calls = TorchKernel(), rank, me, nth, 0

    def forward(self, *a, **kw):
        self.calls += 1
        if self.me == self.rank and self.calls == self.nth:
            os._exit(7)
        return self.inner.forward(*a, **kw)

    def backward(self, *a, **kw):
        return self.inner.backward(*a, **kw)


def _dead_peer(rank, world):
    # C = 1, P = 4: a ring of 4 steps; rank 2 dies computing step 1, so rank 3 is left
    # waiting for the KV that rank 2 was to pass on.
    groups = st.StarTrailGroups.create(1)
    q, k, v, _ = make_inputs(0, 8 * world, 1, 2, 2, D)
    local = [shard(x, rank, world, True) for x in (q, k, v)]
    st.startrail_attention(*local, groups, kernel=_DieOnRank(2, rank, nth=3))


def test_dead_peer_ends_in_an_error_naming_the_peer():
    t0 = time.monotonic()
    with pytest.raises(MultiRankError) as err:
        run_ranks(4, _dead_peer, timeout=20)
    text = str(err.value)
    assert "rank 2 died" in text  # its exit code may not be reaped yet
    assert "StarTrail P2P exchange failed" in text, text[-3000:]
    assert "from CP rank 2 (global 2)" in text, text[-3000:]
    assert time.monotonic() - t0 < 40


def _strided(rank, world):
    """CP groups of strided global ranks ([0, 2, 4, 6] and [1, 3, 5, 7], as with DP inner)."""
    import torch.distributed as dist

    cps = [dist.new_group(list(range(i, 8, 2))) for i in (0, 1)]  # every rank, same order
    cp = cps[rank % 2]
    groups = st.StarTrailGroups.create(2, cp_group=cp)
    p, r = 4, groups.cp_rank
    q, k, v, do = make_inputs(rank % 2, 8 * p, 2, 4, 2, D)
    local = [shard(x, r, p, True).requires_grad_() for x in (q, k, v)]
    out = st.startrail_attention(*local, groups)
    out.backward(shard(do, r, p, True))
    team = dist.get_process_group_ranks(groups.team_group)
    return rank % 2, r, team, [out.detach(), *(x.grad for x in local)]


def test_strided_cp_groups_with_teams_match_the_reference():
    results = run_ranks(8, _strided)
    for g in (0, 1):
        rows = sorted((x for x in results if x[0] == g), key=lambda x: x[1])
        assert [x[2] for x in rows] == [[g, g + 2], [g, g + 2], [g + 4, g + 6], [g + 4, g + 6]]
        ref = reference(*make_inputs(g, 32, 2, 4, 2, D), True)
        for i in range(4):
            got = unshard([x[3][i] for x in rows], True)
            assert rel_err(got, ref[i]) <= TOL[torch.float64]


def _many_settings(rank, world):
    from startrail_megatron.validation import agree_once

    groups = st.StarTrailGroups.create(1)
    k = torch.zeros(2, 1, 1, D)
    for s in range(2, 1202, 2):  # 600 settings, as packed micro-batches give
        agree_once(groups, torch.zeros(s, 1, 1, D), k, True, scale=1.0)
    return len(groups.agreed)


def test_the_cache_of_agreed_settings_stays_bounded():
    assert all(n <= 256 for n in run_ranks(2, _many_settings))
