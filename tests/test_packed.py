"""Packed documents under StarTrail (core): the per-document zigzag layout.

Pure: the layout's checks, and an exhaustive coverage check of the rows each rank computes
(every same-document (query, key) pair the mask allows, over real tokens only, exactly once
per team; never a pair across documents or with padding). Multi-rank (gloo) and one-process:
out, dq, dk, dv against float64 attention per document (fp64 1e-10, fp32 1e-5), padding rows
(random values in the inputs, found from the layout's definition) with zero output and zero
gradients, ledgers equal to the accounting, bad boundaries refused before any transfer.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from common import (
    TOL,
    assert_padding_rows_zero,
    assert_startrail_ledger,
    groups_for,
    noisy_packed_shards,
    packed_inputs,
    packed_reference,
    reference_per_document,
    rel_err,
    value_errors,
)
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.accounting import LocalShape
from startrail_megatron.one_process import one_process_attention
from startrail_megatron.schedule import packed_team_order, startrail_step_rows
from startrail_megatron.schedule.packing import PackedLayout, pack_lengths

B, HQ, HKV, D = 1, 4, 2, 16


# ---- the layout -------------------------------------------------------------------------
def test_pack_lengths_pads_each_document_to_2p():
    lay = pack_lengths([5, 0, 1, 13], 2)
    assert lay.cu_seqlens == (0, 5, 5, 6, 19)
    assert lay.cu_seqlens_padded == (0, 8, 8, 12, 28)
    assert lay.s_local == 14 and lay.num_docs == 4
    # rank 0 holds chunks 0 and 3 of each document: (source row, local row, tokens)
    assert lay.local_rows(0) == [(0, 0, 2), (5, 4, 1), (6, 6, 4), (18, 10, 1)]


@pytest.mark.parametrize(
    "cu, padded, match",
    [
        ([0, 5, 3], [0, 8, 8], "cu_seqlens must not decrease: entry 2"),
        ([1, 5], [0, 8], "cu_seqlens must start at 0"),
        ([0, 5], [0, 8, 16], "same documents"),
        ([0, 5], [0, 6], "padded to 6 tokens, not a multiple of 2 \\* cp_size = 8"),
        ([0, 9], [0, 8], "document 0 has 9 real tokens but only 8 padded"),
        ([0, 2.5], None, "must hold integers"),
        (torch.tensor([0.0, 8.0]), None, "must hold integers, got torch.float32"),
        (torch.zeros(2, 2, dtype=torch.int32), None, "must be 1-D"),
    ],
)
def test_bad_boundaries_name_the_argument(cu, padded, match):
    with pytest.raises(ValueError, match=match):
        PackedLayout.create(4, cu, padded)


def _coverage(p, c, placement, causal, lengths):
    """Count, over every rank and step, how often each (query, key) pair of real tokens is
    computed, in global (document, position) terms."""
    lay = st.StarTrailLayout(p, c, placement)
    packed = pack_lengths(lengths, p)
    s = packed.s_local
    # global identity of each local row of each rank: (doc, position) or None for padding
    local = []
    for r in range(p):
        rows = [None] * s
        for d in range(packed.num_docs):
            cd, off = packed.chunk_len(d), packed.local_offsets[d]
            for half, j in enumerate((r, 2 * p - 1 - r)):
                for i in range(cd):
                    pos = j * cd + i
                    rows[off + half * cd + i] = (d, pos) if pos < packed.lengths[d] else None
        local.append(rows)
    team_rows = []
    for t in range(lay.num_teams):
        gathered = [x for r in lay.team_ranks(t) for x in local[r]]
        team_rows.append([gathered[i] for i in packed_team_order(lay, t, packed)])
    seen: dict = {}
    for r in range(p):
        t = lay.coord(r)[0]
        for step in range(lay.ring_size):
            kv = team_rows[lay.kv_team_at_step(r, step)]
            for call in startrail_step_rows(lay, r, step, causal, s, packed):
                ql, qh, kl, kh, cz = call.q_lo, call.q_hi, call.kv_lo, call.kv_hi, call.causal
                assert qh > ql and kh > kl
                if cz:
                    assert qh - ql == kh - kl
                for i in range(ql, qh):
                    for j in range(kl, kh):
                        if cz and j - kl > i - ql:
                            continue
                        qi, kj = team_rows[t][i], kv[j]
                        assert qi is not None and kj is not None, "a padding row in a call"
                        assert qi[0] == kj[0], "a pair across documents"
                        if causal:
                            assert kj[1] <= qi[1], "a masked pair"
                        seen[qi, kj] = seen.get((qi, kj), 0) + 1
    want = {
        ((d, i), (d, j))
        for d, n in enumerate(lengths)
        for i in range(n)
        for j in range(n)
        if not causal or j <= i
    }
    return seen, want


LENGTH_SETS = [[17, 31, 11], [3, 20], [0, 10, 0, 5], [50], [1, 1, 1], [7, 0]]


@pytest.mark.parametrize(
    "p, c", [(4, 1), (4, 2), (8, 1), (8, 2), (9, 3), (16, 2), (16, 4), (18, 3)]
)
@pytest.mark.parametrize("placement", ["team", "ring"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_same_document_pair_once_per_team_and_nothing_else(p, c, placement, causal):
    rng = random.Random(p * 100 + c)
    for lengths in LENGTH_SETS + [[rng.randint(0, 40) for _ in range(rng.randint(1, 5))]]:
        seen, want = _coverage(p, c, placement, causal, lengths)
        # each team computes each of its query rows against every key once: pairs are
        # counted once per (query, key), since a query row belongs to one team
        assert set(seen) == want, lengths
        assert set(seen.values()) <= {1}, lengths


# ---- multi-rank against float64 per document -----------------------------------------------
def _inputs(lengths, seed=0):
    return packed_inputs(lengths, B, HQ, HKV, D, seed)


def _packed_case(rank, world, c, placement, causal, lengths, dtype):
    packed = pack_lengths(lengths, world)
    q, k, v, d_out = noisy_packed_shards(_inputs(lengths), lengths, world, rank, dtype)
    local = [x.requires_grad_() for x in (q, k, v)]
    ledger = st.CommLedger()
    out = st.startrail_attention(
        *local,
        groups_for(c, placement),
        causal=causal,
        ledger=ledger,
        cu_seqlens=list(packed.cu_seqlens),
        cu_seqlens_padded=torch.tensor(packed.cu_seqlens_padded, dtype=torch.int32),
    )
    out.backward(d_out)
    return [out.detach(), *(x.grad for x in local)], list(ledger.events)


def _check_packed(results, p, c, placement, causal, lengths, dtype, tol):
    packed = pack_lengths(lengths, p)
    ref = packed_reference(tuple(lengths), causal, B, HQ, HKV, D, seed=0)  # _inputs(lengths)
    # zero output and zero gradients on the padding rows (random in the inputs)
    assert_padding_rows_zero([res[0] for res in results], lengths, p)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = st.unshard_packed([res[0][i] for res in results], packed)
        assert got.dtype == dtype and got.shape == ref[i].shape
        err = rel_err(got, ref[i])
        assert err <= tol, f"{what}: {err:.2e} > {tol:.0e}"
    el = torch.empty((), dtype=dtype).element_size()
    shape = LocalShape(packed.s_local, B, HQ, HKV, D, el, max(el, 4))
    lay = st.StarTrailLayout(p, c, placement)
    for r, (_, events) in enumerate(results):  # the same transfers as a dense sequence
        assert_startrail_ledger(events, lay, r, shape)


@pytest.mark.parametrize(
    "p, c, placement, lengths",
    [
        (4, 2, "team", [17, 31, 11]),
        (4, 1, "team", [3, 20]),  # a document shorter than 2P
        (4, 2, "ring", [0, 10, 0, 5]),  # zero-length documents
        (8, 2, "ring", [50]),  # one document only
        (8, 2, "team", [2039, 1013, 509]),
        (9, 3, "team", [23, 1, 40]),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_matches_fp64_per_document(p, c, placement, lengths, causal, dtype):
    results = run_ranks(p, _packed_case, c, placement, causal, lengths, dtype)
    _check_packed(results, p, c, placement, causal, lengths, dtype, TOL[dtype])


@functools.cache
def _p16_case():
    """The documents, inputs and float64 reference of the P = 16 cases, computed once. The
    long document spans every rank's two chunks with padding (1021 tokens in 32 chunks of
    32); at 4093 tokens (chunks of 128) its reference alone took 10.7 CPU s."""
    rng = random.Random(7)
    lengths = [rng.choice([0, 1, 5, 33, 100, 257]) for _ in range(6)] + [1021, 127]
    inputs = _inputs(lengths, seed=3)
    return lengths, inputs, reference_per_document(lengths, True, *inputs)


@pytest.mark.parametrize("p, c", [(16, 1), (16, 2), (16, 4)])
@pytest.mark.parametrize("placement", ["team", "ring"])
def test_packed_one_process_p16(p, c, placement):
    lengths, inputs, ref = _p16_case()
    packed = pack_lengths(lengths, p)
    shards = [noisy_packed_shards(inputs, lengths, p, r) for r in range(p)]
    leaves = [[shards[r][i].requires_grad_() for r in range(p)] for i in range(3)]
    outs = one_process_attention(
        *leaves,
        c,
        placement=placement,
        kernel="torch",
        cu_seqlens=packed.cu_seqlens,
        cu_seqlens_padded=packed.cu_seqlens_padded,
    )
    torch.autograd.backward(outs, [shards[r][3] for r in range(p)])
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    per_rank = [[t[r].detach() for t in got] for r in range(p)]
    assert_padding_rows_zero(per_rank, lengths, p)
    for i in range(4):
        full = st.unshard_packed([t.detach() for t in got[i]], packed)
        assert rel_err(full, ref[i]) <= 1e-10


def test_bf16_no_worse_than_one_device_bf16():
    """bf16 StarTrail against float64, beside one-device bf16 attention per document on the
    same rounded inputs (SDPA, the same kernel): within 1.5x of its error (+ 1e-3)."""
    lengths, p = [200, 37, 91], 4
    results = run_ranks(p, _packed_case, 2, "team", True, lengths, torch.bfloat16)
    packed = pack_lengths(lengths, p)
    rounded = [x.to(torch.bfloat16).double() for x in _inputs(lengths)]
    ref = reference_per_document(lengths, True, *rounded)
    one = [[], [], [], []]
    at = 0
    for n in lengths:
        sl = slice(at, at + n)
        qkv = [x[sl].to(torch.bfloat16).permute(1, 2, 0, 3).requires_grad_() for x in rounded[:3]]
        qkv[1], qkv[2] = (
            x.repeat_interleave(HQ // HKV, 1).detach().requires_grad_() for x in qkv[1:]
        )
        o = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)
        o.backward(rounded[3][sl].to(torch.bfloat16).permute(1, 2, 0, 3))
        grads = [qkv[0].grad] + [g.grad.unflatten(1, (HKV, HQ // HKV)).sum(2) for g in qkv[1:]]
        for i, x in enumerate([o.detach(), *grads]):
            one[i].append(x.permute(2, 0, 1, 3))
        at += n
    for i in range(4):
        got = st.unshard_packed([r[0][i] for r in results], packed)
        single = rel_err(torch.cat(one[i]), ref[i])
        assert rel_err(got, ref[i]) <= 1.5 * single + 1e-3, (i, rel_err(got, ref[i]), single)


def _packed_misuse(rank, world):
    groups = groups_for(2, "team")
    packed = pack_lengths([20, 12], world)
    x = torch.randn(packed.s_local, 1, 2, D, dtype=torch.float64)
    ledger = st.CommLedger()

    def call(**kw):
        return lambda: st.startrail_attention(x, x, x, groups, ledger=ledger, **kw)

    msgs = value_errors(
        {
            "end": call(cu_seqlens=[0, 20, 28], cu_seqlens_padded=[0, 24, 32]),
            "order": call(cu_seqlens=[0, 20, 12], cu_seqlens_padded=[0, 24, 16]),
            "padded_only": call(cu_seqlens_padded=[0, 24, 40]),
            "multiple": call(cu_seqlens=[0, 20, 32], cu_seqlens_padded=[0, 20, 40]),
        }
    )
    assert not ledger.events, "nothing may be sent before validation"
    # ranks that disagree on the documents: all raise, none hang
    mine = [0, 20, 32] if rank else [0, 24, 32]
    msgs.update(value_errors({"ranks": call(cu_seqlens=mine, cu_seqlens_padded=[0, 24, 40])}))
    return msgs, len(ledger.events)


def test_bad_packed_input_is_refused_before_any_transfer():
    for msgs, sent in run_ranks(4, _packed_misuse):
        assert "cu_seqlens_padded ends at 32, but the sequence has" in msgs["end"]
        assert "cu_seqlens must not decrease" in msgs["order"]
        assert "cu_seqlens_padded needs cu_seqlens" in msgs["padded_only"]
        assert "not a multiple of 2 * cp_size = 8" in msgs["multiple"]
        assert msgs["ranks"] is not None and "disagree on cu_seqlens" in msgs["ranks"]
        assert sent == 0
