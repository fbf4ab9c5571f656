"""StarTrail x Ulysses, the 2-D split (core): ``UlyssesStarTrailGroups``.

Pure: the layout's ranks and checks, the KV head rule, and that the all-to-all's reordering
gives each ring rank exactly R's zigzag shard (dense and per document). Multi-rank (gloo, 8
ranks): out, dq, dk, dv (and the sinks' gradient) against float64 attention on one device
for causal and full attention, GQA (KV heads sharded, and repeated when fewer than U),
both placements, packed documents (padding rows zero), a window, soft-capping; the ledger
proves the split ran: each all-to-all sends (U-1)/U of its tensor over the Ulysses group,
and StarTrail's own transfers are those of R ranks on ``[U*s, b, h/U, d]``. Refusals
before any transfer.
"""

from __future__ import annotations

import pytest
import torch
from common import (
    assert_padding_rows_zero,
    assert_startrail_ledger,
    make_inputs,
    noisy_packed_shards,
    reference,
    rel_err,
    shard,
    unshard,
    value_errors,
)
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.accounting import LocalShape, split_comm_bytes, split_comm_calls
from startrail_megatron.schedule.packing import PackedLayout, pack_lengths
from startrail_megatron.schedule.ulysses import UlyssesLayout, kv_repeat, ring_segments

P = 8
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


# ---- pure --------------------------------------------------------------------------------
def test_layout_ranks():
    lay = UlyssesLayout(8, 2, 2)
    assert lay.ring_size == 4 and lay.ring == st.StarTrailLayout(4, 2, "team")
    assert [lay.coord(p) for p in range(8)] == [(r, u) for r in range(4) for u in range(2)]
    assert lay.ulysses_ranks(1) == [2, 3] and lay.ring_ranks(1) == [1, 3, 5, 7]
    # every CP rank is in exactly one Ulysses group and one ring group
    for lay in (UlyssesLayout(16, 4, 2, "ring"), UlyssesLayout(12, 3, 2), UlyssesLayout(8, 8, 1)):
        u, r = lay.ulysses_size, lay.ring_size
        assert sorted(x for i in range(r) for x in lay.ulysses_ranks(i)) == list(range(lay.cp_size))
        assert sorted(x for i in range(u) for x in lay.ring_ranks(i)) == list(range(lay.cp_size))


@pytest.mark.parametrize(
    "args, match",
    [
        (
            (8, 3, 1),
            "ulysses_size=3 does not fit context-parallel size 8: .*allowed: \\[1, 2, 4, 8\\]",
        ),
        ((8, 0, 1), "ulysses_size=0"),
        ((8, 2, 4), "leaves R = 4 ranks per ring group for StarTrail: team_size=4"),
        ((8, 2, 2, "zz"), "placement='zz'"),
    ],
)
def test_layout_refuses_bad_settings(args, match):
    with pytest.raises(ValueError, match=match):
        UlyssesLayout(*args)


def test_kv_heads_sharded_or_repeated():
    assert kv_repeat(2, 8, 4) == 1 and kv_repeat(4, 8, 2) == 2 and kv_repeat(4, 4, 1) == 4
    with pytest.raises(ValueError, match="ulysses_size=4 must divide the query heads \\(6\\)"):
        kv_repeat(4, 6, 2)
    with pytest.raises(ValueError, match="ulysses_size=4 and the key/value heads \\(6\\)"):
        kv_repeat(4, 12, 6)


@pytest.mark.parametrize("p, u", [(8, 2), (8, 4), (12, 3), (8, 8), (4, 1)])
def test_ring_order_is_the_ring_ranks_zigzag(p, u):
    """Token positions through the all-to-all and ``ring_segments``: ring rank r holds R's
    zigzag chunks r and 2R-1-r, dense and per document (padded documents of P's layout)."""
    r_size, n = p // u, 4 * p
    pos = torch.arange(n)
    for r in range(r_size):
        got = torch.cat([shard(pos, r * u + m, p, True) for m in range(u)])
        runs = ring_segments(u, (n // p,))
        got = torch.cat([got[a : a + k] for a, k in runs])
        assert torch.equal(got, shard(pos, r, r_size, True)), (p, u, r)
    lengths = [5, 0, 2 * p + 3, 1]
    packed = pack_lengths(lengths, p)
    ring_packed = PackedLayout.create(r_size, packed.cu_seqlens, packed.cu_seqlens_padded)
    pos = torch.arange(sum(lengths))
    docs = tuple(2 * packed.chunk_len(d) for d in range(packed.num_docs))
    for r in range(r_size):
        got = torch.cat([st.shard_packed(pos, packed, r * u + m) for m in range(u)])
        got = torch.cat([got[a : a + k] for a, k in ring_segments(u, docs)])
        assert torch.equal(got, st.shard_packed(pos, ring_packed, r)), (p, u, r)
    assert ring_segments(u, None) == []


# ---- multi-rank ----------------------------------------------------------------------------
_GROUPS: dict = {}


def _groups(u, c, placement="team"):
    key = (u, c, placement)
    if key not in _GROUPS:
        _GROUPS[key] = st.UlyssesStarTrailGroups.create(u, c, placement=placement)
    return _GROUPS[key]


def _case(rank, world, u, c, placement, causal, shape, dtype, kw, use_sinks):
    zigzag = causal or "window" in kw  # a window needs the zigzag layout, causal or not
    q, k, v, do = (shard(x, rank, world, zigzag).to(dtype) for x in make_inputs(0, *shape))
    hq = shape[2]
    leaves = [x.requires_grad_() for x in (q, k, v)]
    sinks = None
    if use_sinks:
        sinks = torch.linspace(-1, 1, hq, dtype=dtype).requires_grad_()
    ledger = st.CommLedger()
    out = st.startrail_attention(
        *leaves, _groups(u, c, placement), causal=causal, ledger=ledger, sinks=sinks, **kw
    )
    out.backward(do)
    grads = [out.detach(), *(x.grad for x in leaves)]
    return grads, None if sinks is None else sinks.grad, list(ledger.events)


def _split_events(events):
    ulysses = [e for e in events if e.what.endswith("(ulysses)")]
    return ulysses, [e for e in events if not e.what.endswith("(ulysses)")]


def _check_ledger(results, u, c, placement, shape, dtype, active=None):
    n, b, hq, hkv, d = shape
    s, el = n // P, torch.empty((), dtype=dtype).element_size()
    hkv_sent = max(hkv, u)  # repeated up to U when fewer (Note [the 2-D split], GQA)
    lay = UlyssesLayout(P, u, c, placement)
    inner = LocalShape(u * s, b, hq // u, hkv_sent // u, d, el, max(el, 4))
    for p, (_, _, events) in enumerate(results):
        a2a, rest = _split_events(events)
        want = {
            ("fwd", "q (ulysses)"): s * b * hq * d,
            ("fwd", "k (ulysses)"): s * b * hkv_sent * d,
            ("fwd", "v (ulysses)"): s * b * hkv_sent * d,
            ("fwd", "out (ulysses)"): s * b * hq * d,
            ("bwd", "dout (ulysses)"): s * b * hq * d,
            ("bwd", "dq (ulysses)"): s * b * hq * d,
            ("bwd", "dk (ulysses)"): s * b * hkv_sent * d,
            ("bwd", "dv (ulysses)"): s * b * hkv_sent * d,
        }
        got = {(e.phase, e.what): e.nbytes for e in a2a}
        assert got == {k: (u - 1) * v * el // u for k, v in want.items()}, p
        assert {e.op for e in a2a} == {"all_to_all"} and len(a2a) == 8
        ring_rank, u_rank = lay.coord(p)
        assert_startrail_ledger(rest, lay.ring, ring_rank, inner, active)
        # every transfer names the global ranks it went to (bytes per link class): the
        # all-to-alls their Ulysses group, a sub-ring send its peer's CP rank, not its
        # ring rank (CP group = world here)
        assert {e.group for e in a2a} == {tuple(lay.ulysses_ranks(ring_rank))}, p
        ring = lay.ring_ranks(u_rank)
        for e in rest:
            if e.kind == "p2p":
                assert e.group == (ring[e.peer],), (p, e)
            else:
                assert set(e.group) <= set(ring) and p in e.group, (p, e)
        # the totals are the accounting's (what the planner and the benchmark charge)
        led, shape_p = (
            st.CommLedger.from_events(events),
            LocalShape(s, b, hq, hkv, d, el, max(el, 4)),
        )
        want_bytes = split_comm_bytes(lay, p, shape_p, active)
        for ph in ("fwd", "bwd"):
            for kind in ("p2p", "collective"):
                assert led.bytes(kind, ph) == want_bytes[f"{ph}_{kind}"], (p, ph, kind)
        calls = split_comm_calls(lay, p, _tail_groups(lay, inner), active)
        assert led.calls("collective", "fwd") == calls["fwd_collective"], p
        assert led.calls("collective", "bwd") == calls["bwd_collective"], p


def _tail_groups(lay, inner):
    from startrail_megatron.schedule import tail_head_groups

    return len(tail_head_groups(lay.ring, inner.heads_q, inner.heads_kv, False))


def _check(results, causal, shape, dtype, kw, use_sinks):
    full = make_inputs(0, *shape)
    sinks = torch.linspace(-1, 1, shape[2], dtype=dtype).double() if use_sinks else None
    ref = reference(*full, causal, sinks=sinks, **kw)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = unshard([r[0][i] for r in results], causal or "window" in kw)
        assert got.dtype == dtype and got.shape == ref[i].shape
        err = rel_err(got, ref[i])
        assert err <= TOL[dtype], f"{what}: relative max error {err:.2e}"
    if use_sinks:  # every rank's part (its heads, its ring rank's rows) sums to the whole
        total = sum(r[1].double() for r in results)
        assert rel_err(total, ref[4]) <= TOL[dtype]


CASES = [
    # (u, c, placement, causal, (n, b, hq, hkv, d), dtype, kw, sinks)
    (2, 2, "team", True, (64, 2, 4, 2, 8), torch.float64, {}, False),
    (2, 2, "ring", False, (64, 1, 4, 2, 8), torch.float64, {}, False),
    (4, 1, "team", True, (64, 1, 4, 1, 8), torch.float64, {}, True),  # KV repeated 4x
    # 2 KV heads repeated 2x for U = 4: each query head pair must meet its own KV head (with
    # one KV head, tiling and interleaving the repeats agree and cannot be told apart)
    (4, 1, "team", True, (64, 1, 8, 2, 8), torch.float64, {}, False),
    (2, 2, "team", True, (96, 1, 4, 1, 8), torch.float32, {"window": (20, 0)}, False),
    (
        2,
        1,
        "team",
        False,
        (64, 1, 8, 4, 8),
        torch.float64,
        {"window": (9, 5), "softcap": 2.0},
        True,
    ),
    (8, 1, "team", True, (32, 1, 8, 8, 4), torch.float64, {}, False),  # Ulysses only, R = 1
]


@pytest.mark.parametrize("u, c, placement, causal, shape, dtype, kw, use_sinks", CASES)
def test_split_matches_fp64_on_one_device(u, c, placement, causal, shape, dtype, kw, use_sinks):
    results = run_ranks(P, _case, u, c, placement, causal, shape, dtype, kw, use_sinks)
    _check(results, causal, shape, dtype, kw, use_sinks)
    active = None
    if "window" in kw:
        from startrail_megatron.schedule import normalize_window, startrail_active_steps

        r = P // u
        win = normalize_window(kw["window"], shape[0], causal)
        active = startrail_active_steps(UlyssesLayout(P, u, c, placement).ring, shape[0] // r, win)
    _check_ledger(results, u, c, placement, shape, dtype, active)


def _packed_case(rank, world, u, c, lengths, causal):
    packed = pack_lengths(lengths, world)
    total = sum(lengths)
    full = make_inputs(1, total, 1, 4, 2, 8)
    q, k, v, do = noisy_packed_shards(full, lengths, world, rank)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    ledger = st.CommLedger()
    out = st.startrail_attention(
        *leaves, _groups(u, c), causal=causal, ledger=ledger,
        cu_seqlens=list(packed.cu_seqlens), cu_seqlens_padded=list(packed.cu_seqlens_padded),
    )  # fmt: skip
    out.backward(do)
    return [out.detach(), *(x.grad for x in leaves)], None, list(ledger.events)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents(causal):
    lengths, u, c = [37, 0, 61, 5], 2, 2
    results = run_ranks(P, _packed_case, u, c, lengths, causal)
    packed = pack_lengths(lengths, P)
    full = make_inputs(1, sum(lengths), 1, 4, 2, 8)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ref = reference(*full, causal, doc_ids=doc_ids)
    assert_padding_rows_zero([r[0] for r in results], lengths, P)
    for i in range(4):
        got = st.unshard_packed([r[0][i] for r in results], packed)
        assert rel_err(got, ref[i]) <= 1e-10, i
    _check_ledger(results, u, c, "team", (packed.total, 1, 4, 2, 8), torch.float64)


def _misuse(rank, world):
    groups = _groups(2, 2)
    ledger = st.CommLedger()
    x = torch.randn(8, 1, 4, 8, dtype=torch.float64)

    def call(q=x, k=x, **kw):
        return lambda: st.startrail_attention(q, k, k, groups, ledger=ledger, **kw)

    msgs = value_errors(
        {
            "dropout": call(dropout_p=0.1),
            "joint": call(causal=False, joint_kv=(x[:2], x[:2])),
            "heads": call(q=torch.randn(8, 1, 6, 8, dtype=torch.float64), k=x[:, :, :3]),
            "odd": call(q=x[:7], k=x[:7]),
        }
    )
    # a kernel without the variant: refused by name (as without the split) before any transfer
    kernel = value_errors({"k": call(kernel="sdpa", window=(3, 0))}, NotImplementedError)
    msgs["kernel"] = kernel["k"]
    bad_ring = value_errors({"r": lambda: st.UlyssesStarTrailGroups.create(2, 4)})["r"]
    # ranks that disagree on the setting: all raise the same error, none hangs
    bad_u = value_errors({"u": lambda: st.UlyssesStarTrailGroups.create(2 if rank else 4, 1)})
    return msgs, bad_ring, bad_u["u"], len(ledger.events)


def test_bad_input_is_refused_before_any_transfer():
    for msgs, bad_ring, bad_u, sent in run_ranks(P, _misuse):
        assert "dropout_p > 0 is not supported with ulysses_size > 1" in msgs["dropout"]
        assert "joint_kv is not supported with ulysses_size > 1" in msgs["joint"]
        assert "ulysses_size=2 and the key/value heads (3)" in msgs["heads"]
        assert "even s_local" in msgs["odd"]
        assert "kernel='sdpa' cannot run these inputs: does not run sliding windows" in (
            msgs["kernel"] or ""
        )
        assert "leaves R = 4 ranks per ring group" in bad_ring
        assert "disagree on (ulysses_size, team_size, placement)" in bad_u
        assert sent == 0
