"""The one-process mode against real gloo ranks: identical bits, identical ledgers.

Every rank of a forked gloo pool runs ``startrail_attention`` on its shard; rank
0 then also runs ``one_process_attention`` over all shards of the same inputs
(same process settings: one intra-op thread). Outputs and gradients of every
rank must be bitwise equal, and every rank's ledger must list the same events.
"""

from __future__ import annotations

import pytest
import torch
from common import groups_for, make_inputs, reference, rel_err, shard, unshard
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.one_process import RankTimer, one_process_attention

S_LOCAL, BATCH, HEAD_DIM = 4, 2, 32


def _inputs(p, hq, hkv, causal, dtype, seed=3):
    q, k, v, do = make_inputs(seed, S_LOCAL * p, BATCH, hq, hkv, HEAD_DIM)
    return [[shard(x, r, p, causal).to(dtype) for r in range(p)] for x in (q, k, v, do)]


def _one_process(p, c, placement, causal, hq, hkv, dtype, kernel):
    qs, ks, vs, dos = _inputs(p, hq, hkv, causal, dtype)
    leaves = [[x.clone().requires_grad_() for x in xs] for xs in (qs, ks, vs)]
    ledgers = [st.CommLedger() for _ in range(p)]
    outs = one_process_attention(
        *leaves, c, placement=placement, causal=causal, kernel=kernel, ledgers=ledgers
    )
    torch.autograd.backward(outs, dos)
    per_rank = [[outs[r].detach(), *(xs[r].grad for xs in leaves)] for r in range(p)]
    return per_rank, [led.events for led in ledgers]


def _both(rank, world, c, placement, causal, hq, hkv, dtype, kernel):
    qs, ks, vs, dos = _inputs(world, hq, hkv, causal, dtype)
    local = [x[rank].clone().requires_grad_() for x in (qs, ks, vs)]
    ledger = st.CommLedger()
    out = st.startrail_attention(
        *local, groups_for(c, placement), causal=causal, kernel=kernel, ledger=ledger
    )
    out.backward(dos[rank])
    multi = ([out.detach(), *(x.grad for x in local)], ledger.events)
    single = (
        _one_process(world, c, placement, causal, hq, hkv, dtype, kernel) if rank == 0 else None
    )
    return multi, single


CASES = [
    # (P, C, placement, causal, (hq, hkv), dtype, kernel)
    (4, 1, "team", True, (4, 4), torch.float32, "auto"),
    (4, 2, "team", True, (8, 2), torch.float32, "auto"),
    (4, 2, "ring", False, (8, 2), torch.float64, "auto"),
    (8, 2, "team", True, (8, 2), torch.bfloat16, "auto"),
    (8, 2, "ring", True, (4, 4), torch.float32, "torch"),
    (8, 1, "team", False, (4, 1), torch.float32, "auto"),
    (9, 3, "team", True, (4, 2), torch.float32, "auto"),
    (16, 4, "team", True, (4, 2), torch.float32, "auto"),
]


@pytest.mark.parametrize(
    "p,c,placement,causal,heads,dtype,kernel",
    [
        pytest.param(*case, id=f"P{case[0]}-C{case[1]}-{case[2]}-{'causal' if case[3] else 'full'}"
                     f"-{case[4][0]}x{case[4][1]}-{str(case[5])[6:]}-{case[6]}")
        for case in CASES
    ],
)  # fmt: skip
def test_one_process_is_bitwise_the_multi_rank_run(p, c, placement, causal, heads, dtype, kernel):
    hq, hkv = heads
    results = run_ranks(p, _both, c, placement, causal, hq, hkv, dtype, kernel)
    single, single_events = results[0][1]
    for r, ((got, events), _) in enumerate(results):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, single[r]):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape
            assert torch.equal(a, b), (
                f"rank {r} {name}: max |diff| {(a.double() - b.double()).abs().max():.3e}"
            )
        assert events == single_events[r], f"rank {r}: ledgers differ"
    if dtype == torch.float64:  # and both are right
        q, k, v, do = make_inputs(3, S_LOCAL * p, BATCH, hq, hkv, HEAD_DIM)
        ref = reference(q, k, v, do, causal)
        for i in range(4):
            assert rel_err(unshard([s[i] for s in single], causal), ref[i]) <= 1e-10


def test_one_process_without_ranks_matches_reference_and_times_ranks():
    p, c, hq, hkv = 8, 2, 4, 2
    qs, ks, vs, dos = _inputs(p, hq, hkv, True, torch.float64)
    leaves = [[x.clone().requires_grad_() for x in xs] for xs in (qs, ks, vs)]
    timer = RankTimer(p)
    outs = one_process_attention(*leaves, c, timer=timer)
    fwd = timer.totals()
    assert len(fwd) == p and all(t > 0 for t in fwd)
    timer.reset()
    torch.autograd.backward(outs, dos)
    assert all(t > 0 for t in timer.totals())
    q, k, v, do = make_inputs(3, S_LOCAL * p, BATCH, hq, hkv, HEAD_DIM)
    ref = reference(q, k, v, do, True)
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    for i in range(4):
        assert rel_err(unshard(got[i], True), ref[i]) <= 1e-10


def test_one_process_errors():
    qs, ks, vs, _ = _inputs(4, 4, 4, True, torch.float32)
    with pytest.raises(ValueError, match="team_size=3 does not fit context-parallel size 4"):
        one_process_attention(qs, ks, vs, 3)
    with pytest.raises(ValueError, match="one tensor per rank; got 4, 3, 4"):
        one_process_attention(qs, ks[:3], vs, 2)
    bad = [[*xs[:3], xs[3].double()] for xs in (qs, ks, vs)]
    with pytest.raises(ValueError, match=r"q_shards\[3\] is .* torch.float64 .* must agree"):
        one_process_attention(*bad, 2)

    class Boom:
        name = "boom"

        def forward(self, q, k, v, *, causal, scale):
            raise ArithmeticError("kernel failed")

    with pytest.raises(RuntimeError, match=r"rank \d failed") as info:
        one_process_attention(qs, ks, vs, 2, kernel=Boom())
    assert isinstance(info.value.__cause__, ArithmeticError)


def test_a_wait_nobody_can_satisfy_is_reported_as_deadlock():
    from startrail_megatron.comm.in_process import Baton

    baton = Baton(3, torch.device("cpu"), None)
    never = [lambda: baton.wait_until(0, lambda: False), lambda: 1, lambda: 2]
    with pytest.raises(RuntimeError, match=r"deadlock\); waiting ranks: \[0\]"):
        baton.run(never)
    assert Baton(2, torch.device("cpu"), None).run([lambda: 5, lambda: 6]) == [5, 6]


def test_saved_tensors_own_their_storage_and_no_double_backward():
    """What the backward keeps per rank is q_team, kv_team, lse and out, each in its own
    buffer (a view of the gathered [q | k,v] buffer would keep all of it alive), and a
    second-order gradient is an error rather than silently wrong."""
    p, c = 4, 2
    qs, ks, vs, dos = _inputs(p, 8, 2, True, torch.float32)
    leaves = [[x.clone().requires_grad_() for x in xs] for xs in (qs, ks, vs)]
    outs = one_process_attention(*leaves, c, causal=True)
    saved = outs[0].grad_fn.saved_tensors  # one node for all ranks: 4 per rank
    assert len(saved) == 4 * p
    for t in saved:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), t.shape
    # A loss linear in the output (a frozen projection): once_differentiable let this
    # through, and the gradient penalty's second-order terms were silently missing.
    w = torch.randn_like(outs[0])
    with pytest.raises(RuntimeError, match="one_process_attention has no double backward"):
        torch.autograd.grad((outs[0] * w).sum(), leaves[0][0], create_graph=True)
    with pytest.raises(RuntimeError, match="one_process_attention has no double backward"):
        torch.autograd.grad((outs[0] ** 2).sum(), leaves[0][0], create_graph=True)
