"""The peers (all-gather-KV, DeepSpeed-Ulysses) against the float64 reference, on 4 gloo ranks.

Every case: out, dq, dk, dv gathered and unsharded match dense float64
attention (fp32: max abs error <= 1e-5 of the reference's max magnitude), and
each rank's ledger equals the peer's accounting function. For Ulysses, whose
all-to-alls DeepSpeed makes, the ledger is also checked against the
``torch.distributed.all_to_all_single`` calls that really happened.
"""

from __future__ import annotations

import pytest
import torch
from common import TOL, assert_matches_reference, make_inputs, reference, shard
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron import accounting, peers
from startrail_megatron.accounting import LocalShape

S_LOCAL, BATCH, HEAD_DIM, P = 4, 2, 32, 4
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _peer_case(rank, world, name, causal, hq, hkv, dtype):
    import torch.distributed as dist

    q, k, v, do = make_inputs(1, S_LOCAL * world, BATCH, hq, hkv, HEAD_DIM)
    local = [shard(x, rank, world, causal).to(dtype).requires_grad_() for x in (q, k, v)]
    ledger = st.CommLedger()
    fn = {"allgather": peers.allgather_attention, "ulysses": peers.ulysses_attention}[name]
    seen: list[int] = []
    real = dist.all_to_all_single

    def counting(output, input, *a, **kw):
        seen.append(input.numel() * input.element_size())
        return real(output, input, *a, **kw)

    dist.all_to_all_single = counting
    try:
        out = fn(*local, None, causal=causal, ledger=ledger)
        out.backward(shard(do, rank, world, causal).to(dtype))
    finally:
        dist.all_to_all_single = real
    return [out.detach(), *(x.grad for x in local)], ledger.events, seen


CASES = [
    pytest.param(
        name, causal, heads, dt, id=f"{name}-{'causal' if causal else 'full'}-{heads}-{dt}"
    )
    for name, heads_set in (("allgather", ("mha", "gqa")), ("ulysses", ("mha", "gqa4")))
    for causal in (True, False)
    for heads in heads_set
    for dt in DTYPES
]
HEADS = {"mha": (4, 4), "gqa": (8, 2), "gqa4": (8, 4)}


@pytest.mark.parametrize("name,causal,heads,dt", CASES)
def test_peer_matches_fp64_reference_and_accounting(name, causal, heads, dt):
    hq, hkv = HEADS[heads]
    dtype = DTYPES[dt]
    results = run_ranks(P, _peer_case, name, causal, hq, hkv, dtype)
    q, k, v, do = make_inputs(1, S_LOCAL * P, BATCH, hq, hkv, HEAD_DIM)
    assert_matches_reference(results, reference(q, k, v, do, causal), causal, dtype, TOL[dtype])
    el = torch.empty((), dtype=dtype).element_size()
    shape = LocalShape(
        s_local=S_LOCAL,
        batch=BATCH,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=HEAD_DIM,
        elem_bytes=el,
        acc_bytes=max(el, 4),
    )
    bytes_fn = {
        "allgather": accounting.allgather_comm_bytes,
        "ulysses": accounting.ulysses_comm_bytes,
    }
    calls_fn = {
        "allgather": accounting.allgather_comm_calls,
        "ulysses": accounting.ulysses_comm_calls,
    }
    want = bytes_fn[name](P, shape)
    want_calls = calls_fn[name](P)
    for _, events, seen in results:
        led = st.CommLedger.from_events(events)
        for ph in ("fwd", "bwd"):
            for kind in ("p2p", "collective"):
                assert led.bytes(kind, ph) == want[f"{ph}_{kind}"], (ph, kind)
                assert led.calls(kind, ph) == want_calls[f"{ph}_{kind}"], (ph, kind)
        if name == "ulysses":  # the ledger's taps against DeepSpeed's real all-to-alls
            assert len(seen) == led.calls("collective") == 8
            assert sum(seen) * (P - 1) // P == led.bytes("collective")
        else:
            assert seen == []


def _ulysses_bad_heads(rank, world):
    ledger = st.CommLedger()
    x = torch.randn(4, 1, 6, 8)
    try:
        peers.ulysses_attention(x, x, x, None, ledger=ledger)
    except ValueError as e:
        return str(e), len(ledger.events)
    return None, len(ledger.events)


def test_ulysses_rejects_heads_not_divisible_by_cp():
    for msg, n in run_ranks(P, _ulysses_bad_heads):
        assert msg is not None and "multiples of the CP size 4" in msg and n == 0


def test_accounting_is_pure_and_consistent():
    shape = LocalShape(s_local=8, batch=1, heads_q=8, heads_kv=2, head_dim=16, elem_bytes=2)
    ag = accounting.allgather_comm_bytes(4, shape)
    assert ag["fwd_collective"] == 3 * 2 * 8 * 2 * 16 * 2
    assert ag["bwd_collective"] == 3 * 2 * 8 * 2 * 16 * (2 + 4)
    ul = accounting.ulysses_comm_bytes(4, shape)
    assert (
        ul["fwd_collective"]
        == ul["bwd_collective"]
        == 3 * (2 * 8 * 8 * 16 + 2 * 8 * 2 * 16) * 2 // 4
    )
    assert accounting.ulysses_comm_bytes(1, shape)["fwd_collective"] == 0
    assert accounting.ulysses_supported(4, 8, 4) and not accounting.ulysses_supported(4, 8, 2)
