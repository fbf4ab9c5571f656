"""Sliding windows, logit soft-capping and attention sinks under StarTrail (core).

Pure: the windowed block plan computes every (query, key) pair the window (and the causal
mask) allows exactly once and no other, each call trimmed so every row and key has a pair
(exhaustive over layouts, windows shorter than a chunk, spanning chunk and team boundaries,
as long as the sequence). Numerics: out, dq, dk, dv (and the sinks' gradient) against a
float64 attention with the window, cap and sinks applied to the whole sequence, one process
(P = 4 - 16, both placements, causal and full) and gloo ranks, at 1e-10; a window that masks
nothing is bitwise the code without one. Bad settings are refused by name before any
transfer, on every rank.
"""

from __future__ import annotations

import pytest
import torch
from common import assert_startrail_ledger, groups_for, value_errors
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.one_process import one_process_attention
from startrail_megatron.schedule import (
    band_pairs,
    buffer_chunks,
    normalize_window,
    startrail_step_packed_window_rows,
    startrail_step_rows,
    startrail_step_window_rows,
)
from startrail_megatron.schedule.packing import pack_lengths

HQ, HKV, D = 4, 2, 8


# ---- the plan ------------------------------------------------------------------------------
def _coverage(p, c, placement, causal, s_local, window):
    lay = st.StarTrailLayout(p, c, placement)
    ch = s_local // 2

    def pos(team):
        return [x * ch + i for x in buffer_chunks(lay, team, causal) for i in range(ch)]

    seen: dict = {}
    for r in range(p):
        team = lay.coord(r)[0]
        for step in range(lay.ring_size):
            qp, kp = pos(team), pos(lay.kv_team_at_step(r, step))
            for call in startrail_step_window_rows(lay, r, step, causal, s_local, window):
                ql, qh, kl, kh, (lo, hi) = call.q_lo, call.q_hi, call.kv_lo, call.kv_hi, call.band
                rows, cols = set(), set()
                for i in range(qh - ql):
                    for j in range(kh - kl):
                        if (lo is not None and j - i < lo) or (hi is not None and j - i > hi):
                            continue
                        rows.add(i)
                        cols.add(j)
                        key = (qp[ql + i], kp[kl + j])
                        seen[key] = seen.get(key, 0) + 1
                # trimmed: every row and every key of a call has a pair in the band
                assert rows == set(range(qh - ql)) and cols == set(range(kh - kl))
                assert band_pairs(qh - ql, kh - kl, lo, hi) == sum(
                    1 for i in range(qh - ql) for j in range(kh - kl)
                    if (lo is None or j - i >= lo) and (hi is None or j - i <= hi)
                )  # fmt: skip
    n = p * s_local
    left, right = window
    want = {
        (i, j)
        for i in range(n)
        for j in range(n)
        if (not causal or j <= i)
        and (left is None or j >= i - left)
        and (right is None or j <= i + right)
    }
    return seen, want


@pytest.mark.parametrize("p, c", [(4, 1), (4, 2), (8, 2), (9, 3), (16, 4)])
@pytest.mark.parametrize("placement", ["team", "ring"])
@pytest.mark.parametrize("causal", [True, False])
def test_window_plan_computes_every_pair_in_the_window_once(p, c, placement, causal):
    s_local = 6  # chunks of 3 tokens
    n = p * s_local
    windows = [(0, 0), (1, 0), (2, 0), (4, None), (3, 3), (5, 1), (7, 0), (n // 2, None)]
    windows += [(None, 2), (n - 2, 0)]  # right only; all but one pair
    for window in windows:
        if causal:
            window = (window[0], None)
        seen, want = _coverage(p, c, placement, causal, s_local, window)
        assert set(seen) == want, window
        assert set(seen.values()) == {1}, window


def test_narrow_windows_skip_work():
    """W = S/16 and S/4: the calls cover the window's pairs in rectangles of at most about
    twice their pairs (a kernel that skips tiles outside the band computes less still),
    far less than the causal plan's calls."""
    p, c, s_local = 8, 2, 64
    n = p * s_local
    lay = st.StarTrailLayout(p, c)
    full = sum(
        (b - a) * (d - cc)
        for r in range(p)
        for step in range(lay.ring_size)
        for a, b, cc, d in (
            (x.q_lo, x.q_hi, x.kv_lo, x.kv_hi)
            for x in startrail_step_rows(lay, r, step, True, s_local)
        )
    )
    for w, bound in ((n // 16, 0.35), (n // 4, 0.6)):
        calls = [
            call
            for r in range(p)
            for step in range(lay.ring_size)
            for call in startrail_step_window_rows(lay, r, step, True, s_local, (w - 1, None))
        ]
        area = sum(x.nq * x.nk for x in calls)
        pairs = sum(band_pairs(x.nq, x.nk, *x.band) for x in calls)
        assert pairs == sum(min(i + 1, w) for i in range(n))  # exactly the window's pairs
        assert area <= 2.2 * pairs and area < bound * full, (w, area, pairs, full)


def test_normalize_window():
    assert normalize_window(None, 64, True) is None
    assert normalize_window((-1, 0), 64, True) is None  # plain causal
    assert normalize_window((-1, -1), 64, False) is None
    assert normalize_window((63, 0), 64, True) is None  # as long as the sequence
    assert normalize_window((63, 63), 64, False) is None
    assert normalize_window((15, 0), 64, True) == (15, None)
    assert normalize_window([3, 5], 64, False) == (3, 5)
    assert normalize_window((-1, 2), 64, False) == (None, 2)
    for bad in ((-2, 0), (1.5, 0), (1,), "16", (True, 0), (0, None)):
        with pytest.raises(ValueError, match="window="):
            normalize_window(bad, 64, True)


# ---- numerics against float64 --------------------------------------------------------------
def reference(q, k, v, do, causal, window, softcap=0.0, sinks=None):
    """float64 attention over the whole sequence with the window, cap and sinks."""
    leaves = [x.detach().double().clone().requires_grad_() for x in (q, k, v)]
    sink = None if sinks is None else sinks.detach().double().clone().requires_grad_()
    qq, kk, vv = (x.permute(1, 2, 0, 3) for x in leaves)
    g = qq.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
    s = qq @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    n = s.shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = torch.ones(n, n, dtype=torch.bool)
    if causal:
        ok &= j <= i
    left, right = window
    if left != -1:
        ok &= j >= i - left
    if right != -1:
        ok &= j <= i + right
    s = s.masked_fill(~ok, float("-inf"))
    if sink is not None:
        col = sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        prob = torch.softmax(torch.cat((s, col), -1), -1)[..., :n]
    else:
        prob = torch.softmax(s, -1)
    out = (prob @ vv).permute(2, 0, 1, 3)
    out.backward(do.double())
    grads = [x.grad for x in leaves] + ([sink.grad] if sink is not None else [])
    return [out.detach(), *grads]


def _close(got, want, tol=1e-10):
    """Relative to the reference's largest entry; absolute where that is 0 (a window of one
    token gives exactly zero dq, dk)."""
    scale = want.abs().max().clamp_min(1.0)
    return ((got - want).abs().max() / scale).item() <= tol


def _inputs(n, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, b, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)]


WINDOWS = [(0, 0), (2, 0), (3, 1), (5, 5), (11, 0), (-1, 3), (20, -1)]


@pytest.mark.parametrize("p, c, placement", [(4, 2, "team"), (8, 2, "ring"), (9, 3, "team"),
                                             (16, 4, "team"), (4, 1, "ring")])  # fmt: skip
@pytest.mark.parametrize("causal", [True, False])
def test_one_process_window_and_softcap_match_fp64(p, c, placement, causal):
    n = p * 8  # chunks of 4 tokens: the windows are shorter than, and span, chunks and teams
    for w, window in enumerate(WINDOWS):
        cap = 2.0 if w % 2 else None
        q, k, v, do = _inputs(n, seed=w)
        leaves = [[st.testing.shard(x, r, p, True).requires_grad_() for r in range(p)]
                  for x in (q, k, v)]  # fmt: skip
        outs = one_process_attention(
            *leaves, c, placement=placement, causal=causal, kernel="torch", window=window,
            softcap=cap,
        )  # fmt: skip
        torch.autograd.backward(outs, [st.testing.shard(do, r, p, True) for r in range(p)])
        want = reference(q, k, v, do, causal, window, cap or 0.0)
        got = [outs, *([x.grad for x in xs] for xs in leaves)]
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            full = st.testing.unshard([t.detach() for t in got[i]], True)
            assert _close(full, want[i]), (window, cap, what)


def _window_case(rank, world, c, causal, window, cap, with_sinks):
    n = world * 8
    q, k, v, do = _inputs(n)
    sinks = torch.linspace(-1.0, 1.5, HQ, dtype=torch.float64) if with_sinks else None
    leaves = [st.testing.shard(x, rank, world, True).requires_grad_() for x in (q, k, v)]
    sk = sinks.clone().requires_grad_() if with_sinks else None
    out = st.startrail_attention(
        *leaves, groups_for(c), causal=causal, window=window, softcap=cap, sinks=sk,
        kernel="torch",
    )  # fmt: skip
    out.backward(st.testing.shard(do, rank, world, True))
    return [out.detach(), *(x.grad for x in leaves)], (sk.grad if with_sinks else None)


@pytest.mark.parametrize(
    "p, c, causal, window, cap, sinks",
    [
        (4, 2, True, (5, 0), None, True),  # GPT-OSS: causal window and sinks
        (8, 2, True, (-1, 0), 3.0, False),  # Gemma 2 global layers: soft-capping only
        (8, 2, True, (9, 0), 3.0, True),  # window spanning a team (chunks of 4 tokens)
        (4, 1, False, (3, 3), None, True),  # bidirectional window (DiT-style local)
        (9, 3, True, (2, 0), 2.0, False),
    ],
)
def test_startrail_window_softcap_sinks_match_fp64_on_ranks(p, c, causal, window, cap, sinks):
    results = run_ranks(p, _window_case, c, causal, window, cap, sinks)
    q, k, v, do = _inputs(p * 8)
    sk = torch.linspace(-1.0, 1.5, HQ, dtype=torch.float64) if sinks else None
    want = reference(q, k, v, do, causal, window, cap or 0.0, sk)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        full = st.testing.unshard([r[0][i] for r in results], True)
        assert _close(full, want[i]), what
    if sinks:  # each rank holds its rows' part; the parts sum to the gradient
        total = sum(r[1] for r in results)
        assert _close(total, want[4]), (total, want[4])
        assert want[4].abs().max() > 1e-3  # the check can fail
        plain = reference(q, k, v, do, causal, window, cap or 0.0)[0]
        assert (plain - want[0]).abs().max() > 1e-3  # the sinks changed the output


def _no_window_is_bitwise(rank, world):
    q, k, v, do = _inputs(world * 8)
    outs = []
    for kw in ({}, {"window": (-1, 0)}, {"window": (world * 8 - 1, 0)}, {"softcap": 0.0}):
        leaves = [st.testing.shard(x, rank, world, True).requires_grad_() for x in (q, k, v)]
        out = st.startrail_attention(*leaves, groups_for(2), kernel="torch", **kw)
        out.backward(st.testing.shard(do, rank, world, True))
        outs.append([out.detach(), *(x.grad for x in leaves)])
    return outs


def test_a_window_that_masks_nothing_is_bitwise_plain_causal():
    for outs in run_ranks(4, _no_window_is_bitwise):
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def _refusals(rank, world):
    x = torch.randn(8, 1, HQ, D)
    kv = torch.randn(8, 1, HKV, D)
    groups = groups_for(2)
    ledger = st.CommLedger()

    def call(**kw):
        return lambda: st.startrail_attention(x, kv, kv, groups, ledger=ledger, **kw)

    msgs = value_errors(
        {
            "window": call(window=(-3, 0)),
            "window_type": call(window=(2.5, 0)),
            "softcap_nan": call(softcap=float("nan")),
            "softcap_neg": call(softcap=-1.0),
            "sinks_shape": call(sinks=torch.zeros(HQ + 1)),
            "sinks_dtype": call(sinks=torch.zeros(HQ, dtype=torch.long)),
            "sinks_type": call(sinks=[0.0] * HQ),
            # ranks that disagree on the window: all raise, none hang
            "ranks": call(window=(3 + rank % 2, 0)),
        }
    )
    msgs.update(
        value_errors(
            {
                "sdpa": call(kernel="sdpa", window=(3, 0)),
                "sdpa_cap": call(kernel="sdpa", softcap=5.0),
            },
            NotImplementedError,
        )
    )
    return msgs, len(ledger.events)


def test_bad_window_softcap_sinks_are_refused_before_any_transfer():
    for msgs, sent in run_ranks(4, _refusals):
        assert "window=(-3, 0) must be a pair (left, right) of integers >= -1" in msgs["window"]
        assert "window=(2.5, 0)" in msgs["window_type"]
        assert "softcap=nan must be a finite number > 0" in msgs["softcap_nan"]
        assert "softcap=-1.0" in msgs["softcap_neg"]
        assert "sinks must be a floating-point [heads_q] = [4] tensor" in msgs["sinks_shape"]
        assert "torch.int64" in msgs["sinks_dtype"]
        assert "sinks must be a [heads_q] = [4] tensor, got list" in msgs["sinks_type"]
        assert "'sdpa' cannot run these inputs: does not run sliding windows" in msgs["sdpa"]
        assert "does not run logit soft-capping" in msgs["sdpa_cap"]
        assert msgs["ranks"] is not None and "disagree on window left" in msgs["ranks"]
        assert sent == 0


# ---- flash-attn: the band as window_size, soft-capping ---------------------------------------
@pytest.mark.parametrize("version", ["2.6", "2.7-plain", "2.8-custom-op", "2.5"])
@pytest.mark.parametrize("causal", [True, False])
def test_window_and_softcap_on_flash_attn_stand_ins(version, causal):
    """StarTrail's band calls through flash-attn's bottom-right-aligned ``window_size`` (and
    ``softcap`` from 2.6), stand-ins with each release's signature: exact to flash's fp32
    lse; 2.5 (no softcap) refuses soft-capping by name before anything runs."""
    from test_backends import FLASH_VERSIONS

    from startrail_megatron import kernels as kn

    p, c = 8, 2
    n = p * 8
    ker = kn.FlashAttnKernel(FLASH_VERSIONS[version]())
    cap = None if version == "2.5" else 2.0
    for window in [(0, 0), (3, 1), (11, 0), (-1, 5)]:
        q, k, v, do = _inputs(n, seed=1)
        leaves = [[st.testing.shard(x, r, p, True).requires_grad_() for r in range(p)]
                  for x in (q, k, v)]  # fmt: skip
        outs = one_process_attention(
            *leaves, c, causal=causal, kernel=ker, window=window, softcap=cap
        )
        torch.autograd.backward(outs, [st.testing.shard(do, r, p, True) for r in range(p)])
        want = reference(q, k, v, do, causal, window, cap or 0.0)
        got = [outs, *([x.grad for x in xs] for xs in leaves)]
        for i in range(4):
            full = st.testing.unshard([t.detach() for t in got[i]], True)
            assert _close(full, want[i], 1e-6), (version, window, i)
    if version == "2.5":
        x = [st.testing.shard(t, 0, p, True) for t in _inputs(n)[:3]]
        with pytest.raises(NotImplementedError, match="'flash_attn' does not run softcap"):
            one_process_attention(*([t] * p for t in x), c, kernel=ker, softcap=2.0)


def test_flash_window_sizes_from_bands():
    from startrail_megatron.kernels.flash_attn import _window

    assert _window(4, 4, (None, 0)) == (-1, 0)  # causal
    assert _window(4, 4, (-3, 0)) == (3, 0)  # a causal window of 4
    assert _window(4, 10, (None, 6)) == (-1, 0)  # bottom-right: offset 6
    assert _window(3, 5, (-1, 4)) == (3, 2)
    with pytest.raises(ValueError, match="not a flash-attn window"):
        _window(4, 10, (None, 2))  # keys no query sees: trimmed away by the plan


# ---- packed documents ------------------------------------------------------------------------
def _packed_coverage(p, c, placement, causal, lengths, window):
    lay = st.StarTrailLayout(p, c, placement)
    packed = pack_lengths(lengths, p)

    def pos(team):  # (document, position) of each team-buffer row; None for padding
        rows = []
        for d in range(packed.num_docs):
            cd, n = packed.chunk_len(d), packed.lengths[d]
            for j in lay.team_chunks(team):
                rows += [(d, j * cd + i) if j * cd + i < n else None for i in range(cd)]
        return rows

    seen: dict = {}
    for r in range(p):
        team = lay.coord(r)[0]
        for step in range(lay.ring_size):
            qp, kp = pos(team), pos(lay.kv_team_at_step(r, step))
            for call in startrail_step_packed_window_rows(lay, r, step, causal, packed, window):
                ql, qh, kl, kh, (lo, hi) = call.q_lo, call.q_hi, call.kv_lo, call.kv_hi, call.band
                for i in range(qh - ql):
                    for j in range(kh - kl):
                        if (lo is None or j - i >= lo) and (hi is None or j - i <= hi):
                            a, b = qp[ql + i], kp[kl + j]
                            assert a is not None and b is not None and a[0] == b[0]
                            seen[a, b] = seen.get((a, b), 0) + 1
    left, right = window
    want = {
        ((d, i), (d, j))
        for d, n in enumerate(lengths)
        for i in range(n)
        for j in range(n)
        if (not causal or j <= i)
        and (left is None or j >= i - left)
        and (right is None or j <= i + right)
    }
    return seen, want


@pytest.mark.parametrize("p, c", [(4, 1), (4, 2), (8, 2), (9, 3)])
@pytest.mark.parametrize("placement", ["team", "ring"])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_window_plan_covers_each_document_once(p, c, placement, causal):
    for lengths in ([17, 0, 31, 1, 11], [40], [3, 3, 3]):
        for window in ((0, None), (2, None), (5, 1), (12, 3), (None, 2)):
            if causal:
                window = (window[0], None)
            if window == (None, None):
                continue
            seen, want = _packed_coverage(p, c, placement, causal, lengths, window)
            assert set(seen) == want and set(seen.values()) <= {1}, (lengths, window)


def _per_document(lengths, causal, q, k, v, do, window, cap, sinks=None):
    parts = [[] for _ in range(5)]
    at = 0
    for n in lengths:
        if n:
            sl = slice(at, at + n)
            for i, x in enumerate(reference(q[sl], k[sl], v[sl], do[sl], causal, window, cap,
                                            sinks)):  # fmt: skip
                parts[i].append(x)
        at += n
    out = [torch.cat(x) for x in parts[:4]]
    return out + ([sum(parts[4])] if sinks is not None else [])


@pytest.mark.parametrize("p, c, placement", [(4, 2, "team"), (8, 2, "ring"), (16, 4, "team")])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_window_and_softcap_match_fp64_per_document(p, c, placement, causal):
    lengths = [17, 0, 31, 1, 11, 64, 7]
    packed = pack_lengths(lengths, p)
    for window, cap in (((3, 0), 2.0), ((12, 0), None), ((5, 2), 3.0)):
        q, k, v, do = _inputs(sum(lengths), seed=2)
        leaves = [[st.shard_packed(x, packed, r).requires_grad_() for r in range(p)]
                  for x in (q, k, v)]  # fmt: skip
        outs = one_process_attention(
            *leaves, c, placement=placement, causal=causal, kernel="torch", window=window,
            softcap=cap, cu_seqlens=packed.cu_seqlens, cu_seqlens_padded=packed.cu_seqlens_padded,
        )  # fmt: skip
        torch.autograd.backward(outs, [st.shard_packed(do, packed, r) for r in range(p)])
        want = _per_document(lengths, causal, q, k, v, do, window, cap or 0.0)
        got = [outs, *([x.grad for x in xs] for xs in leaves)]
        for i in range(4):
            full = st.unshard_packed([t.detach() for t in got[i]], packed)
            assert _close(full, want[i]), (window, cap, i)


def _packed_case(rank, world, kernel, window, cap):
    from test_backends import FLASH_VERSIONS

    from startrail_megatron import kernels as kn

    lengths = [17, 0, 31, 1, 11, 64, 7]
    packed = pack_lengths(lengths, world)
    q, k, v, do = _inputs(sum(lengths), seed=4)
    sinks = torch.linspace(-1.0, 1.5, HQ, dtype=torch.float64).requires_grad_()
    leaves = [st.shard_packed(x, packed, rank).requires_grad_() for x in (q, k, v)]
    ker = "torch" if kernel == "torch" else kn.FlashAttnKernel(FLASH_VERSIONS[kernel]())
    out = st.startrail_attention(
        *leaves, groups_for(2), window=window, softcap=cap, sinks=sinks, kernel=ker,
        cu_seqlens=packed.cu_seqlens, cu_seqlens_padded=packed.cu_seqlens_padded,
    )  # fmt: skip
    out.backward(st.shard_packed(do, packed, rank))
    pad = torch.ones(packed.s_local, dtype=torch.bool)
    for _, dst, n in packed.local_rows(rank):
        pad[dst : dst + n] = False
    zero_pad = all((x[pad] == 0).all() for x in (out, *(y.grad for y in leaves)))
    return [out.detach(), *(x.grad for x in leaves)], sinks.grad, zero_pad


@pytest.mark.parametrize(
    "kernel, window, cap",
    [("torch", (6, 0), 2.0), ("2.8-custom-op", None, 2.0), ("2.6", (4, 0), None)],
)
def test_packed_window_softcap_sinks_on_ranks(kernel, window, cap):
    """gloo P = 4, C = 2: packed documents with a window, soft-capping and sinks (the
    varlen path for flash-attn's soft-capping without a window), padding rows zero."""
    p = 4
    lengths = [17, 0, 31, 1, 11, 64, 7]
    packed = pack_lengths(lengths, p)
    results = run_ranks(p, _packed_case, kernel, window, cap)
    q, k, v, do = _inputs(sum(lengths), seed=4)
    sinks = torch.linspace(-1.0, 1.5, HQ, dtype=torch.float64)
    want = _per_document(lengths, True, q, k, v, do, window or (-1, 0), cap or 0.0, sinks)
    tol = 1e-10 if kernel == "torch" else 1e-6
    for i in range(4):
        full = st.unshard_packed([r[0][i] for r in results], packed)
        assert _close(full, want[i], tol), i
    assert _close(sum(r[1] for r in results), want[4], tol)
    assert all(r[2] for r in results)  # padding: zero output and gradients


def test_window_needs_an_even_local_length():
    x = [torch.randn(5, 1, HQ, D) for _ in range(2)]
    kv = [torch.randn(5, 1, HKV, D) for _ in range(2)]
    with pytest.raises(ValueError, match="needs the zigzag layout .* got s_local = 5"):
        one_process_attention(x, kv, kv, 1, causal=False, kernel="torch", window=(1, 1))


def test_softcap_with_dropout_never_reaches_flash_attn(monkeypatch):
    """flash-attn refuses soft-capping with dropout ("Softcapping does not support
    dropout"): by name before any transfer when asked for, and "auto" takes the reference
    kernel instead; flash-attn 2.5 (no softcap) likewise."""
    from test_backends import FLASH_VERSIONS

    from startrail_megatron.kernels import choice

    q = torch.zeros(4, 1, 2, 16, dtype=torch.bfloat16)
    flash = kn_flash(FLASH_VERSIONS["2.6"]())
    with pytest.raises(NotImplementedError, match="softcap together with dropout_p > 0"):
        choice.resolve_kernel(q, flash, None, dropout=True, softcap=True)
    assert choice.resolve_kernel(q, flash, None, softcap=True)[0] is flash
    old = kn_flash(FLASH_VERSIONS["2.5"]())
    real = choice.get_kernel
    for instance, kw in ((flash, dict(dropout=True, softcap=True)), (old, dict(softcap=True))):

        def fake(name, *a, _i=instance, **k):
            return _i if name == "auto" else real(name, *a, **k)

        monkeypatch.setattr(choice, "get_kernel", fake)
        assert choice.resolve_kernel(q, "auto", None, **kw)[0].name == "torch"
        with pytest.raises(NotImplementedError, match="'flash_attn' does not run"):
            choice.resolve_kernel(q, instance, None, **kw)


def kn_flash(ns):
    from startrail_megatron import kernels as kn

    return kn.FlashAttnKernel(ns)


# ---- idle sub-ring steps: not computed, their KV not sent ------------------------------------
def _ledger_shape(s_local, b=2):
    from startrail_megatron.accounting import LocalShape

    return LocalShape(s_local, b, HQ, HKV, D, 8, 8)


def _skipped(lay, active) -> int:
    """P2P messages the full schedule sends that the skipping one does not (all ranks)."""
    full = sum(sum(lay.p2p_sends(r, backward=True).values()) for r in range(lay.cp_size))
    got = sum(sum(lay.p2p_sends(r, backward=True, active=active).values())
              for r in range(lay.cp_size))  # fmt: skip
    return full - got


@pytest.mark.parametrize(
    "p, c, placement, window",
    [(8, 1, "team", (2, 0)), (16, 2, "team", (2, 0)), (18, 3, "team", (0, 0)),
     (32, 2, "team", (11, 0)), (16, 2, "ring", (0, 0))],
)  # fmt: skip
def test_idle_steps_are_skipped_and_their_kv_not_sent(p, c, placement, window):
    """Narrow windows leave sub-ring steps with no call on any rank of the sub-ring: they
    are not run, and the KV goes straight past them. Out and every gradient equal float64
    over the whole sequence, and each rank's ledger equals the accounting of the skipping
    schedule, which sends fewer messages than the full one (so the test fails with the
    skipping switched off)."""
    from startrail_megatron.schedule import startrail_active_steps

    s_local = 8
    lay = st.StarTrailLayout(p, c, placement)
    active = startrail_active_steps(lay, True, s_local, (window[0], None))
    assert active is not None and _skipped(lay, active) > 0
    q, k, v, do = _inputs(p * s_local, seed=3)
    leaves = [[st.testing.shard(x, r, p, True).requires_grad_() for r in range(p)]
              for x in (q, k, v)]  # fmt: skip
    ledgers = [st.CommLedger() for _ in range(p)]
    outs = one_process_attention(
        *leaves, c, placement=placement, causal=True, kernel="torch", window=window,
        ledgers=ledgers,
    )  # fmt: skip
    torch.autograd.backward(outs, [st.testing.shard(do, r, p, True) for r in range(p)])
    want = reference(q, k, v, do, True, window, 0.0)
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        full = st.testing.unshard([t.detach() for t in got[i]], True)
        assert _close(full, want[i]), what
    for r in range(p):
        assert_startrail_ledger(ledgers[r].events, lay, r, _ledger_shape(s_local), active)


def _skip_case(rank, world, c, window, lengths):
    ledger = st.CommLedger()
    if lengths is None:
        q, k, v, do = _inputs(world * 8, b=1, seed=5)

        def cut(x):
            return st.testing.shard(x, rank, world, True)

        kw = {}
    else:
        packed = pack_lengths(lengths, world)
        q, k, v, do = _inputs(sum(lengths), b=1, seed=5)

        def cut(x):
            return st.shard_packed(x, packed, rank)

        kw = {"cu_seqlens": packed.cu_seqlens, "cu_seqlens_padded": packed.cu_seqlens_padded}
    leaves = [cut(x).requires_grad_() for x in (q, k, v)]
    out = st.startrail_attention(
        *leaves, groups_for(c), window=window, kernel="torch", ledger=ledger, **kw
    )
    out.backward(cut(do))
    return [out.detach(), *(x.grad for x in leaves)], ledger.events


@pytest.mark.parametrize(
    "c, lengths, window", [(1, None, (2, 0)), (2, None, (0, 0)), (1, [40, 24], (2, 0))]
)
def test_idle_steps_skipped_on_ranks(c, lengths, window):
    """The same on 8 gloo ranks (process groups, the sub-ring's P2P past idle steps), dense
    and with packed documents (the window inside each document); at C = 2 some sub-rings
    compute only their second step (the placement goes straight to its holders)."""
    from startrail_megatron.accounting import LocalShape
    from startrail_megatron.schedule import startrail_active_steps

    p = 8
    results = run_ranks(p, _skip_case, c, window, lengths)
    lay = st.StarTrailLayout(p, c)
    if lengths is None:
        s_local, packed = 8, None
        q, k, v, do = _inputs(p * s_local, b=1, seed=5)
        want = reference(q, k, v, do, True, window, 0.0)
    else:
        packed = pack_lengths(lengths, p)
        s_local = packed.s_local
        q, k, v, do = _inputs(sum(lengths), b=1, seed=5)
        want = _per_document(lengths, True, q, k, v, do, window, 0.0, None)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        shards = [r[0][i] for r in results]
        if packed is None:
            full = st.testing.unshard(shards, True)
        else:
            full = st.unshard_packed(shards, packed)
        assert _close(full, want[i]), what
    active = startrail_active_steps(lay, True, s_local, (window[0], None), packed)
    assert active is not None and _skipped(lay, active) > 0
    shape = LocalShape(s_local, 1, HQ, HKV, D, 8, 8)
    for r, (_, events) in enumerate(results):
        assert_startrail_ledger(events, lay, r, shape, active)
