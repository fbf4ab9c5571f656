"""Head chunks (``startrail_attention(head_chunks=)``, ``--startrail-attention-head-chunks``):
the call runs on one group of KV heads (with its query heads) at a time, forward and
backward, so every team-sized buffer holds 1/n of the heads.

* Several ranks: out and every gradient match float64 attention (causal GQA, full MHA with
  sinks, a window with soft-capping, combined with the tile, the 2-D split) and packed
  documents match their per-document reference; joint keys (MMDiT) match the unchunked
  call. Proof it ran: no kernel call saw more than 1/n of the query heads (more without),
  n times the transfers of the same bytes, and a lower attention peak than whole heads.
* Bad settings are a ``ValueError`` naming ``head_chunks`` before any transfer.
"""

from __future__ import annotations

import pytest
import torch
from common import (
    TOL,
    assert_dense_parity,
    dense_rank_inputs,
    groups_for,
    make_inputs,
    packed_inputs,
    packed_reference,
    shard,
)
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.bench.memory import LiveTensorBytes
from startrail_megatron.kernels import TorchKernel
from startrail_megatron.schedule.packing import pack_lengths

S_LOCAL, BATCH, D = 12, 1, 8


class _Heads(TorchKernel):
    """The reference kernel, recording the most query heads any call saw."""

    def __init__(self):
        super().__init__()
        self.heads = 0

    def forward(self, q, k, v, **kw):
        self.heads = max(self.heads, q.shape[2])
        return super().forward(q, k, v, **kw)

    def backward(self, do, q, k, v, *a, **kw):
        self.heads = max(self.heads, q.shape[2])
        return super().backward(do, q, k, v, *a, **kw)


def _groups(c: int, u: int):
    if u == 1:
        return groups_for(c)
    return st.UlyssesStarTrailGroups.create(u, c)


def _chunked_rank(rank, world, c, u, causal, hq, hkv, window, softcap, sinks_on, tile, chunks):
    groups = _groups(c, u)
    local, dout, sinks = dense_rank_inputs(
        rank, world, S_LOCAL, BATCH, (hq, hkv), D, causal, window, sinks_on
    )
    kern, ledger = _Heads(), st.CommLedger()
    with LiveTensorBytes() as live:
        base = live.current
        out = st.startrail_attention(
            *local, groups, causal=causal, kernel=kern, window=window, softcap=softcap,
            sinks=sinks, tile=tile, ledger=ledger, head_chunks=chunks,
        )  # fmt: skip
        out.backward(dout)
        peak = live.peak - base
    grads = [out.detach(), *(x.grad for x in local)]
    moved = sum(e.nbytes for e in ledger.events)
    proof = (kern.heads, len(ledger.events), moved, peak)
    return grads, (None if sinks is None else sinks.grad), proof


CASES = [
    pytest.param(4, 2, 1, True, (8, 2), None, None, False, None, 2, id="P4-C2-causal-gqa"),
    pytest.param(8, 2, 1, False, (4, 4), None, None, True, None, 4, id="P8-C2-full-sinks"),
    pytest.param(
        8, 2, 1, True, (4, 2), (5, 0), 2.0, True, None, 2, id="P8-C2-window-softcap-sinks"
    ),
    pytest.param(4, 2, 1, True, (8, 4), None, None, False, 5, 2, id="P4-C2-causal-tile5"),
    pytest.param(8, 2, 2, True, (8, 4), None, None, False, None, 2, id="P8-U2-C2-split"),
]


@pytest.mark.parametrize("p,c,u,causal,heads,window,cap,sinks,tile,n", CASES)
def test_head_chunks_match_fp64_and_ran(p, c, u, causal, heads, window, cap, sinks, tile, n):
    hq, hkv = heads
    args = (c, u, causal, hq, hkv, window, cap, sinks, tile)
    res = run_ranks(p, _chunked_rank, *args, n)
    whole = run_ranks(p, _chunked_rank, *args, None)
    assert_dense_parity(res, p, S_LOCAL, BATCH, heads, D, causal, window, cap, sinks)
    ring_hq = hq // u  # the heads each ring rank runs (the 2-D split shards them)
    for r, (got, want) in enumerate(zip(res, whole)):
        heads, events, moved, peak = got[2]
        w_heads, w_events, w_moved, w_peak = want[2]
        # chunked: no call on more than a chunk's heads; whole: larger calls (not always
        # all heads: the last sub-ring step runs in head groups, and under a narrow window
        # it is the only step with calls)
        assert heads <= ring_hq // n and heads < w_heads <= ring_hq, (r, heads, w_heads)
        assert moved == w_moved, r  # the same bytes ...
        assert events > w_events, r  # ... in more messages
        assert peak < w_peak, (r, peak, w_peak)  # team buffers of 1/n of the heads


def _packed_rank(rank, world, c, lengths, chunks):
    lay = pack_lengths(lengths, world)
    q, k, v, do = packed_inputs(lengths, 1, 4, 2, D, 11)
    local = [st.shard_packed(x, lay, rank).requires_grad_() for x in (q, k, v)]
    kern = _Heads()
    out = st.startrail_attention(
        *local, groups_for(c), causal=True, kernel=kern, cu_seqlens=lay.cu_seqlens,
        cu_seqlens_padded=lay.cu_seqlens_padded, head_chunks=chunks,
    )  # fmt: skip
    out.backward(st.shard_packed(do, lay, rank))
    return [out.detach(), *(x.grad for x in local)], kern.heads


def test_head_chunks_with_packed_documents():
    """Packed documents (causal, per-document zigzag): each document's real rows match its
    float64 reference with two head chunks, every call on one KV head's query heads."""
    p, c, lengths = 4, 2, (21, 8, 27)
    lay = pack_lengths(lengths, p)
    res = run_ranks(p, _packed_rank, c, lengths, 2)
    want = packed_reference(lengths, True, 1, 4, 2, D, 11)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = st.unshard_packed([r[0][i] for r in res], lay)
        err = st.testing.rel_err(got, want[i])
        assert err <= TOL[torch.float64], (what, err)
    assert all(r[1] == 2 for r in res)


def _joint_rank(rank, world, c, chunks):
    n, t, hq, hkv = S_LOCAL * world, 5, 4, 2
    q, k, v, do = make_inputs(7, n, BATCH, hq, hkv, D)
    kt, vt = (x.clone().requires_grad_() for x in make_inputs(8, t, BATCH, hkv, hkv, D)[1:3])
    local = [shard(x, rank, world, False).requires_grad_() for x in (q, k, v)]
    kern = _Heads()
    out = st.startrail_attention(
        *local, groups_for(c), causal=False, kernel=kern, joint_kv=(kt, vt), head_chunks=chunks
    )
    out.backward(shard(do, rank, world, False))
    return [out.detach(), *(x.grad for x in local), kt.grad, vt.grad], kern.heads


def test_head_chunks_with_joint_keys_match_whole_heads():
    """Joint keys (MMDiT's text tokens, the same on every rank): two head chunks give the
    unchunked call's output and gradients, the joint keys' too (float64, 1e-12)."""
    p, c = 4, 2
    res = run_ranks(p, _joint_rank, c, 2)
    whole = run_ranks(p, _joint_rank, c, None)
    for (got, heads), (want, w_heads) in zip(res, whole):
        assert heads == 2 and w_heads == 4
        for g, w in zip(got, want):
            assert (g - w).abs().max().item() <= 1e-12 * max(1.0, w.abs().max().item())


def _refused(rank, world, bad, dropout_p, u):
    q, k, v, _ = make_inputs(0, 8 * world, 1, 4, 2, 4)
    local = [shard(x, rank, world, True).double() for x in (q, k, v)]
    ledger = st.CommLedger()
    try:
        st.startrail_attention(
            *local, _groups(1, u), kernel="torch", ledger=ledger, head_chunks=bad,
            dropout_p=dropout_p,
        )  # fmt: skip
    except ValueError as e:
        return str(e), len(ledger.events)
    return None, len(ledger.events)


@pytest.mark.parametrize(
    "bad,dropout_p,u,match",
    [
        (0, 0.0, 1, r"head_chunks=0 must be None or an integer >= 1"),
        (True, 0.0, 1, r"head_chunks=True must be None or an integer"),
        (3, 0.0, 1, r"head_chunks=3 must divide the KV heads \(2\); allowed: \[1, 2\]"),
        (2, 0.0, 2, r"head_chunks=2 must divide the KV heads \(1\); allowed: \[1\]"),
        (2, 0.1, 1, r"head_chunks=2 with dropout_p=0.1 is not supported yet"),
    ],
)
def test_bad_head_chunks_are_refused_by_name_before_any_transfer(bad, dropout_p, u, match):
    import re

    for msg, sent in run_ranks(2, _refused, bad, dropout_p, u):
        assert msg is not None and re.search(match, msg), msg
        assert sent == 0
