"""Layouts and dtypes the main grid does not reach, against the float64 reference.

Multi-rank (gloo): MQA, full attention with an odd local length, head_dim not a power of
two, fp16, bf16 with full attention and with MHA at P != 8. One-process mode (every rank
of the schedule in this process, bitwise a multi-rank run): C >= 3 with sub-rings longer
than one rank, P = 18, C = 3 and P = 32, C = 4, both placements. Each case checks out, dq,
dk, dv and every rank's recorded bytes and calls against the accounting.
"""

from __future__ import annotations

import pytest
import torch
from common import (
    TOL,
    assert_matches_reference,
    assert_startrail_ledger,
    groups_for,
    make_inputs,
    reference,
    rel_err,
    shard,
    unshard,
)
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.accounting import LocalShape
from startrail_megatron.one_process import one_process_attention

# Rounded inputs (fp16, bf16) against float64 on the same rounded values: the peers'
# tolerances (flash-attn's tests, ring-flash-attention) for max error / max magnitude.
LOW_TOL = {torch.float16: 5e-3, torch.bfloat16: 2.5e-2}


def _run(rank, world, c, causal, s_local, b, hq, hkv, d, dtype):
    q, k, v, do = make_inputs(3, s_local * world, b, hq, hkv, d)
    local = [shard(x, rank, world, causal).to(dtype).requires_grad_() for x in (q, k, v)]
    ledger = st.CommLedger()
    out = st.startrail_attention(*local, groups_for(c), causal=causal, ledger=ledger)
    out.backward(shard(do, rank, world, causal).to(dtype))
    return [out.detach(), *(x.grad for x in local)], list(ledger.events)


def _shape(s_local, b, hq, hkv, d, dtype) -> LocalShape:
    el = torch.empty((), dtype=dtype).element_size()
    return LocalShape(s_local, b, hq, hkv, d, el, 8 if dtype == torch.float64 else 4)


CASES = {
    # name: (P, C, causal, s_local, batch, hq, hkv, head_dim, dtype)
    "mqa-causal-fp64": (4, 2, True, 4, 2, 4, 1, 16, torch.float64),
    "mqa-full-fp32": (4, 2, False, 4, 2, 4, 1, 16, torch.float32),
    "full-odd-s_local-fp64": (4, 2, False, 3, 2, 4, 2, 16, torch.float64),
    "full-odd-s_local-ring-fp32": (4, 1, False, 5, 1, 2, 2, 16, torch.float32),
    "head_dim-24-fp32": (4, 2, True, 4, 2, 4, 2, 24, torch.float32),
    "head_dim-40-fp64": (4, 2, True, 4, 1, 2, 2, 40, torch.float64),
    "fp16-causal": (4, 2, True, 8, 1, 4, 2, 32, torch.float16),
    "fp16-full-ring": (4, 1, False, 8, 1, 4, 4, 32, torch.float16),
    "bf16-full-gqa": (4, 2, False, 8, 1, 4, 2, 32, torch.bfloat16),
    "bf16-causal-mha": (4, 2, True, 8, 1, 4, 4, 32, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_multi_rank_layouts_match_fp64(name):
    p, c, causal, s_local, b, hq, hkv, d, dtype = CASES[name]
    results = run_ranks(p, _run, c, causal, s_local, b, hq, hkv, d, dtype)
    q, k, v, do = make_inputs(3, s_local * p, b, hq, hkv, d)
    ref = reference(*(x.to(dtype).double() for x in (q, k, v, do)), causal)
    assert_matches_reference(results, ref, causal, dtype, TOL.get(dtype, LOW_TOL.get(dtype)))
    lay = st.StarTrailLayout(p, c)
    for r, (_, events) in enumerate(results):
        assert_startrail_ledger(events, lay, r, _shape(s_local, b, hq, hkv, d, dtype))


@pytest.mark.parametrize("p, c", [(18, 3), (32, 4), (27, 3)])
@pytest.mark.parametrize("placement", ["team", "ring"])
def test_one_process_large_teams_with_sub_rings_match_fp64(p, c, placement):
    lay = st.StarTrailLayout(p, c, placement)
    assert lay.ring_size > 1  # sub-rings longer than one rank: the ring steps run
    s_local, b, hq, hkv, d = 2, 1, 2, 1, 8
    q, k, v, do = make_inputs(5, s_local * p, b, hq, hkv, d)
    leaves = [[shard(x, r, p, True).clone().requires_grad_() for r in range(p)] for x in (q, k, v)]
    ledgers = [st.CommLedger() for _ in range(p)]
    outs = one_process_attention(
        *leaves, c, placement=placement, causal=True, kernel="torch", ledgers=ledgers
    )
    torch.autograd.backward(outs, [shard(do, r, p, True) for r in range(p)])
    ref = reference(q, k, v, do, True)
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    for i in range(4):
        assert rel_err(unshard([t.detach() for t in got[i]], True), ref[i]) <= 1e-10
    for r in range(p):
        assert_startrail_ledger(
            ledgers[r].events, lay, r, _shape(s_local, b, hq, hkv, d, torch.float64)
        )
