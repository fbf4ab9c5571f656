"""MMDiT joint attention under StarTrail: text tokens replicated, image tokens
sharded (``joint.py``, Note [joint attention]).

Against one device's float64 attention over ``[text; image]``: image out, dq, dk, dv
(unsharded), the text out (the same on every rank) and the text dq, dk, dv as the sum of
the ranks' parts, where each rank's loss covers its own image rows and a different share
of the text output (weights that sum to one), so a gradient counted on every rank, or on
one only, fails. Even and uneven image token counts (padding masked), P = 4 and 8, C = 1
and 2, both placements. The feature ran: the ledger shows StarTrail's P2P and the joint
all-gathers; the text changes the image output (so the check can fail).
"""

from __future__ import annotations

import pytest
import torch
from common import groups_for, own_rows_first_env, value_errors
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.joint import joint_attention, replicated_query_attention
from startrail_megatron.schedule.packing import pack_lengths
from startrail_megatron.zigzag import shard_packed, unshard_packed

HQ, HKV, D, B, T = 4, 2, 8, 2, 5
TOL = 1e-10


def _inputs(n: int):
    """image q, k, v, dout [n, B, h, D] and text q, k, v, dout [T, B, h, D], float64."""
    img = st.testing.make_inputs(7, n, B, HQ, HKV, D)
    txt = st.testing.make_inputs(8, T, B, HQ, HKV, D)
    return img, txt


def _weights(p: int) -> list[float]:
    w = [float(r + 1) for r in range(p)]
    return [x / sum(w) for x in w]


def _joint_case(rank, world, c, placement, n):
    (q, k, v, do), (qt, kt, vt, dot) = _inputs(n)
    lay = pack_lengths([n], world)
    padded = lay.total != n
    cu = {"cu_seqlens": lay.cu_seqlens, "cu_seqlens_padded": lay.cu_seqlens_padded}
    leaves = [shard_packed(x, lay, rank).requires_grad_() for x in (q, k, v)]
    tleaves = [x.clone().requires_grad_() for x in (qt, kt, vt)]
    ledger = st.CommLedger()
    out, out_t = joint_attention(
        *leaves, *tleaves, groups_for(c, placement), kernel="torch", ledger=ledger,
        **(cu if padded else {}),
    )  # fmt: skip
    w = _weights(world)[rank]
    torch.autograd.backward([out, out_t], [shard_packed(do, lay, rank), dot * w])
    ran = {w: ledger.bytes(what=w) for w in ("kv", "kv_place", "joint_out", "joint_dout")}
    return (
        [out.detach(), *(x.grad for x in leaves)],
        [out_t.detach(), *(x.grad for x in tleaves)],
        ran,
    )


def _want(n: int):
    (q, k, v, do), (qt, kt, vt, dot) = _inputs(n)
    cat = [torch.cat(xs) for xs in ((qt, q), (kt, k), (vt, v), (dot, do))]
    ref = st.testing.reference_attention(*cat, causal=False)
    return [x[T:] for x in ref], [x[:T] for x in ref]


def _err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize(
    "p, c, placement, n",
    [
        (4, 2, "team", 32),  # even: no padding
        (4, 2, "ring", 29),  # uneven: 3 padding tokens
        (4, 1, "team", 21),
        (8, 2, "team", 64),
        (8, 2, "ring", 50),  # 14 padding tokens: more than one chunk of rank 0's
    ],
)
def test_joint_attention_matches_one_device(p, c, placement, n):
    results = run_ranks(p, _joint_case, c, placement, n)
    lay = pack_lengths([n], p)
    want_img, want_txt = _want(n)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = unshard_packed([r[0][i] for r in results], lay)
        assert _err(got, want_img[i]) <= TOL, f"image {what}"
    for r in results:  # the text output: the whole one on every rank
        assert _err(r[1][0], want_txt[0]) <= TOL, "text out"
    for i, what in enumerate(("dq", "dk", "dv"), start=1):
        total = sum(r[1][i] for r in results)  # the ranks' parts sum to the gradient
        assert _err(total, want_txt[i]) <= TOL, f"text {what}"
        one = results[0][1][i] * p  # as if every rank held the whole: wrong
        assert _err(one, want_txt[i]) > 1e-3, f"text {what}: the check could not fail"
    for rank, r in enumerate(results):
        ran = r[2]
        assert ran["joint_out"] == (p - 1) * T * B * HQ * (D + 1) * 8, rank
        assert ran["joint_dout"] == (p - 1) * T * B * HQ * D * 8, rank
        assert ran["kv"] + ran["kv_place"] > 0, rank  # StarTrail's team / sub-ring transfers
    # the text keys changed the image rows (a joint attention that dropped them fails)
    (q, k, v, do), _ = _inputs(n)
    alone = st.testing.reference_attention(q, k, v, do, causal=False)[0]
    assert (alone - want_img[0]).abs().max() > 1e-3


def _refusals(rank, world):
    (q, k, v, _), (qt, kt, vt, _) = _inputs(world * 4)
    qs, ks, vs = (st.testing.shard(x, rank, world, False) for x in (q, k, v))
    g = groups_for(2)
    call = lambda **kw: lambda: joint_attention(  # noqa: E731
        *(kw.get(n, x) for n, x in zip(("q", "k", "v"), (qs, ks, vs))),
        *(kw.get(n, x) for n, x in zip(("qt", "kt", "vt"), (qt, kt, vt))),
        g, kernel="torch",
    )  # fmt: skip
    bad = value_errors(
        {
            "text_heads": call(kt=kt[:, :, :1], vt=vt[:, :, :1]),
            "text_tokens": call(kt=kt[:2], vt=vt[:2]),
            "dtype": call(qt=qt.float()),
            "causal": lambda: st.startrail_attention(
                qs, ks, vs, g, causal=True, kernel="torch", joint_kv=(kt, vt)
            ),
            "window": lambda: st.startrail_attention(
                qs, ks, vs, g, causal=False, kernel="torch", joint_kv=(kt, vt), window=(2, 2)
            ),
            "joint_shape": lambda: st.startrail_attention(
                qs, ks, vs, g, causal=False, kernel="torch", joint_kv=(kt[:, :1], vt[:, :1])
            ),
            "groups": lambda: replicated_query_attention(qt, kt, vt, ks, vs, None),
        }
    )
    return bad


def test_joint_attention_refuses_bad_input_by_name():
    for bad in run_ranks(4, _refusals):
        assert "text" in bad["text_heads"] or "k_txt" in bad["text_heads"]
        assert "same tokens" in bad["text_tokens"]
        assert "dtype" in bad["dtype"]
        assert "causal=False" in bad["causal"]
        assert "window" in bad["window"]
        assert "k_joint" in bad["joint_shape"]
        assert "StarTrailGroups" in bad["groups"]


def _joint_own_rows_first(rank, world, c, placement, n):
    """``_joint_case`` with the first step's own rows first, and the own-row calls cut."""
    with own_rows_first_env("on") as made:
        return (*_joint_case(rank, world, c, placement, n), sum(made))


@pytest.mark.parametrize("p, c, n", [(4, 2, 32), (8, 2, 64)])
def test_joint_attention_with_own_rows_first(p, c, n):
    """MMDiT joint attention (dense image tokens) with the split on: exact, and it ran."""
    results = run_ranks(p, _joint_own_rows_first, c, "team", n)
    lay = pack_lengths([n], p)
    want_img, want_txt = _want(n)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = unshard_packed([r[0][i] for r in results], lay)
        assert _err(got, want_img[i]) <= TOL, f"image {what}"
    for i in range(1, 4):
        assert _err(sum(r[1][i] for r in results), want_txt[i]) <= TOL
    assert all(r[3] > 0 for r in results)  # every rank's first step was split
