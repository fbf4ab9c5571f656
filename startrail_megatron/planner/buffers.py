"""Elementwise work on buffers outside the kernels and the communication, per rank.

Each strategy's function here (``strategies.buffer_bytes`` picks it) returns the
(forward, backward) bytes read + written per rank by the tensor ops outside the
kernels and the communication, max over ranks, counted from the implementation's
buffers; they take ``buffer_time`` at ``mem_bw``.

A copy (reorder, ``cat``, ``stack``, ``contiguous``, a permute) of X bytes moves 2X, a
zero-fill X, an accumulation ``acc[rows] += g`` reads and writes ``acc`` and reads ``g``,
a dtype cast reads one dtype and writes the other (nothing when the dtypes agree).
A reduce-scatter over n ranks adds its reductions: ``n-1`` sums of one output-sized
chunk (a ring reduce-scatter), 3 (n-1) output bytes; ``rs_via_allreduce`` (gloo:
clone, all-reduce, copy out) adds the clone of the input and the copy of the output.
The all-gathered buffers' own writes are the collectives' (calibrated with them); the
merges after each forward call are the kernel's (calibrated with it); row statistics
(lse, delta: 1/head_dim of the tensors beside them) are left out.

All-gather-KV works on full-sequence buffers: the gathered K,V reordered into chunk
order (forward and again in the backward), the fp32 dK/dV accumulator over the whole
sequence, its reorder back and the reduce-scatter's reductions of it; StarTrail and ring
on team buffers (C times the local size); Ulysses copies each all-to-all'd tensor once
(DeepSpeed's permute) and reorders the gathered sequence into natural order.
"""

from __future__ import annotations

from ..schedule.layout import StarTrailLayout
from ..schedule.packing import PackedLayout
from .cluster import ClusterSpec
from .compute import allgather_call_shapes, startrail_call_shapes
from .shape import AttnShape

__all__ = [
    "allgather_buffer_bytes",
    "buffer_time",
    "split_a2a_bytes",
    "startrail_buffer_bytes",
    "ulysses_buffer_bytes",
]


def _startrail_rows(
    lay: StarTrailLayout, causal: bool, s_local: int, packed: PackedLayout | None = None
) -> tuple:
    """[rank] -> (q rows, kv rows) summed over this rank's kernel calls of every step (tokens)."""
    steps = startrail_call_shapes(lay, causal, s_local, packed)
    return tuple(
        (
            sum(nq for row in steps for nq, _, _ in row[r]),
            sum(nk for row in steps for _, nk, _ in row[r]),
        )
        for r in range(lay.cp_size)
    )


def _sizes(shape: AttnShape) -> tuple[int, int, int, int, int, int]:
    """(elements of one q row, of one k row, of the local q, of the local k; bytes per
    element of a cast; accumulation bytes)."""
    e, a = shape.elem_bytes, shape.acc_bytes
    rq = shape.batch * shape.heads_q * shape.head_dim  # elements of one q row
    rkv = shape.batch * shape.heads_kv * shape.head_dim  # one k (or v) row
    uq, ukv = shape.s_local * rq, shape.s_local * rkv
    conv = 0 if e == a else a + e  # bytes per element of a cast
    return rq, rkv, uq, ukv, conv, a


def _reduce_scatter(n: int, out_elems: int, acc_bytes: int, rs_via_allreduce: bool) -> int:
    """A reduce-scatter's reductions over n ranks (+ gloo's copies), bytes."""
    return (3 * (n - 1) + (2 * n + 2 if rs_via_allreduce else 0)) * out_elems * acc_bytes


def startrail_buffer_bytes(
    lay: StarTrailLayout, shape: AttnShape, rs_via_allreduce: bool
) -> tuple[int, int]:
    """StarTrail and ring: work on team buffers (C times the local size)."""
    e = shape.elem_bytes
    rq, rkv, uq, ukv, conv, a = _sizes(shape)

    def rs(n: int, out_elems: int) -> int:
        return _reduce_scatter(n, out_elems, a, rs_via_allreduce)

    c = lay.team_size
    reord = shape.causal and c > 1  # the team's [fronts, backs] order (identity for C = 1)
    rows = _startrail_rows(lay, shape.causal, shape.s_local, shape.packed)
    g = lay.ring_size
    f = 4 * ukv * e  # stack k,v
    place = 0  # the placement's C pieces into the team's K,V buffer, in team order
    if c > 1:
        place = 2 * c * 2 * ukv * e + (2 * c * 2 * ukv * e if reord else 0)
    f += place + (2 * c * uq * e if reord else 0)  # and the gathered q's reorder
    f += c * uq * a  # output accumulator zeros
    if c > 1:
        f += 2 * c * uq * a + (2 * c * uq * a if reord else 0) + rs(c, uq)  # rescale, reorder
    f += uq * conv
    b0 = 4 * uq * a + 2 * uq * conv  # delta = rowsum(dout * out)
    b0 += 2 * c * uq * e if reord else 0  # team dout reorder
    b0 += 3 * c * uq * a + 2 * c * uq * conv  # the out stand-in
    b0 += place  # the placement again, from the K,V kept
    b0 += c * uq * a + g * c * 2 * ukv * a + (g - 1) * 3 * c * 2 * ukv * a  # zeros; dkv += recv
    b0 += 2 * c * (uq + 2 * ukv) * a if reord else 0  # dq and dK/dV back to member order
    b0 += (rs(c, uq) if c > 1 else 0) + 3 * (c - 1) * 2 * ukv * a  # dq; the C dK/dV parts summed
    b0 += (uq + 2 * ukv) * conv
    bwd = max(b0 + (qr * rq + 2 * kr * rkv) * (2 * a + e) for qr, kr in rows)
    return f, bwd


def allgather_buffer_bytes(shape: AttnShape, rs_via_allreduce: bool) -> tuple[int, int]:
    """All-gather-KV: work on full-sequence buffers."""
    p, e = shape.cp_size, shape.elem_bytes
    rq, rkv, uq, ukv, conv, a = _sizes(shape)
    full = p * 2 * ukv  # the gathered K,V
    fwd = bwd = 0
    for r in range(p):
        calls = allgather_call_shapes(r, shape)
        qr = sum(sh[0] for sh in calls)  # (q rows, kv rows, causal[, pairs in a window])
        kr = sum(sh[1] for sh in calls)
        reord = 2 * full * e if shape.causal and p > 1 else 0
        f = 4 * ukv * e + reord + uq * a + uq * conv  # stack, reorder, out zeros, cast
        b = 4 * ukv * e + reord + uq * a + full * a  # stack, reorder, dq and dK/dV zeros
        b += (qr * rq + 2 * kr * rkv) * (2 * a + e)  # dq[qs] += g_q, dkv[ks] += g_k, g_v
        if shape.causal and p > 1:
            b += 2 * full * a  # dK/dV back to rank order
        b += _reduce_scatter(p, full // p, a, rs_via_allreduce) + (uq + 2 * ukv) * conv
        fwd, bwd = max(fwd, f), max(bwd, b)
    return fwd, bwd


def ulysses_buffer_bytes(shape: AttnShape, rs_via_allreduce: bool) -> tuple[int, int]:
    """Ulysses: each all-to-all'd tensor copied once (DeepSpeed's permute), and the
    gathered sequence reordered into natural order (causal). No reduce-scatter."""
    del rs_via_allreduce
    e = shape.elem_bytes
    _, _, uq, ukv, _, _ = _sizes(shape)
    moved = (2 * uq + 2 * ukv) * e  # q, k, v, out (forward); dout, dq, dk, dv (backward)
    each = 2 * moved * (2 if shape.causal else 1)  # DeepSpeed's permute (+ our reorder)
    return each, each


def buffer_time(cl: ClusterSpec, nbytes: int) -> float:
    return nbytes / cl.mem_bw if cl.mem_bw > 0 else 0.0


def split_a2a_bytes(ring: AttnShape) -> int:
    """The 2-D split's copies around its four all-to-alls of one direction
    (``rank/ulysses.py``): each tensor permuted into the send buffer and the received rows
    put in ring order, read and written once each: 4 times q, out, and the (repeated) k,
    v. ``ring``: the shape after the all-to-all (the same elements per tensor)."""
    _, _, uq, ukv, _, _ = _sizes(ring)
    return 4 * (2 * uq + 2 * ukv) * ring.elem_bytes
