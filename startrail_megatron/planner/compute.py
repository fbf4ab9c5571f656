"""Kernel time: the kernel calls each rank makes, and what one call costs.

The calls are those the implementations make (``schedule.plan_step`` on the
StarTrail schedule, dense or per packed document, and ``schedule.allgather_calls``), so
causal balance, the diagonal blocks and the calls skipped between documents are counted
exactly. A call costs a fixed overhead plus its
(q, k) pairs at ``attn_flops`` (the masked part of causal diagonal tiles
included), times ``attn_bwd_ratio`` in the backward, plus the K,V re-streaming of
calls too long for the cache (``kv_stream_bytes``).
"""

from __future__ import annotations

from functools import lru_cache

from ..schedule import (
    RowCall,
    allgather_calls,
    band_pairs,
    offset_band,
    plan_step,
    startrail_active_steps,
)
from ..schedule.layout import StarTrailLayout
from ..schedule.packing import PackedLayout
from .cluster import ClusterSpec
from .shape import AttnShape

__all__ = [
    "CallShape",
    "allgather_call_shapes",
    "call_work",
    "kernel_time",
    "kv_stream_bytes",
    "startrail_call_shapes",
    "startrail_own_shapes",
    "startrail_work",
]


CallShape = tuple
"""One kernel call in tokens: (q rows, kv rows, causal), or (q rows, kv rows, False,
pairs) for a windowed call whose band holds ``pairs`` of its q x kv pairs."""


def _shape(call: RowCall) -> CallShape:
    if call.band is not None:
        return (call.nq, call.nk, False, call.pairs())
    return (call.nq, call.nk, call.causal)


@lru_cache(maxsize=256)
def _first_steps(lay, causal, s_local, packed, window, own_first) -> tuple:
    """[rank] -> the first step it computes where the attention splits it
    (``own_first``: ``schedule.splits_first_step``, which never splits packed
    documents), else None."""
    if not own_first or packed is not None:
        return (None,) * lay.cp_size
    active = startrail_active_steps(lay, causal, s_local, window, None)
    return tuple(lay.computed_steps(r, active)[0] for r in range(lay.cp_size))


def _plan(lay, r, step, causal, s_local, packed, window, own_first, varlen=False):
    """Rank r's ``schedule.plan_step`` at ``step``, split where the attention splits it."""
    first = _first_steps(lay, causal, s_local, packed, window, own_first)[r]
    return plan_step(
        lay, r, step, causal=causal, s_local=s_local, packed=packed, window=window,
        varlen=varlen, own_first=step == first,
    )  # fmt: skip


@lru_cache(maxsize=256)
def startrail_call_shapes(
    lay: StarTrailLayout,
    causal: bool,
    s_local: int,
    packed: PackedLayout | None = None,
    window: tuple[int | None, int | None] | None = None,
    own_first: bool = False,
) -> tuple[tuple[tuple[CallShape, ...], ...], ...]:
    """[step][rank] -> the row calls the attention makes (``schedule.plan_step``: dense or
    per packed document; under a normalized ``window`` the banded calls with their
    pairs), in tokens. ``own_first`` (where ``schedule.splits_first_step`` is true): the
    first step a rank computes is split as the attention runs it, its own query rows
    first (``startrail_own_shapes``), then the others (the same pairs, more calls)."""
    return tuple(
        tuple(
            tuple(
                _shape(c)
                for c in _plan(lay, r, step, causal, s_local, packed, window, own_first).row_calls
            )
            for r in range(lay.cp_size)
        )
        for step in range(lay.ring_size)
    )


def startrail_own_shapes(
    lay: StarTrailLayout,
    causal: bool,
    s_local: int,
    packed: PackedLayout | None = None,
    window: tuple[int | None, int | None] | None = None,
    own_first: bool = False,
) -> tuple[tuple[CallShape, ...], ...]:
    """[rank] -> the calls of its first computed step on its own query rows, which run
    while the team's queries (forward) or output gradients (backward) are gathered
    (``attention.py``'s Note [overlap]); empty where the step is not split."""
    firsts = _first_steps(lay, causal, s_local, packed, window, own_first)
    return tuple(
        ()
        if first is None
        else tuple(
            _shape(o.call)
            for o in _plan(lay, r, first, causal, s_local, packed, window, own_first).own
        )
        for r, first in enumerate(firsts)
    )


def window_pairs(nq: int, nk: int, q0: int, k0: int, shape: AttnShape) -> int:
    """(query, key) pairs of a call on global queries [q0, q0 + nq) and keys [k0, k0 + nk)
    inside ``shape``'s window (and its causal mask)."""
    return band_pairs(nq, nk, *offset_band(k0 - q0, shape.band, shape.causal))


def allgather_call_shapes(rank: int, shape: AttnShape) -> tuple[CallShape, ...]:
    """The calls of ``schedule.allgather_calls``, in tokens; under a window each counts
    the pairs inside it (a kernel with the window skips the rest)."""
    calls = allgather_calls(rank, shape.cp_size, shape.causal, shape.s_local)
    if shape.band is None:
        return tuple((qs.stop - qs.start, ks.stop - ks.start, cz) for qs, ks, cz in calls)
    c, p = shape.s_local // 2, shape.cp_size
    out = []
    for qs, ks, _ in calls:
        nk = ks.stop - ks.start
        # the rows' zigzag chunks (a window needs the zigzag layout, causal or not): the
        # full-attention call holds both of the rank's chunks
        for chunk, lo in ((rank, 0), (2 * p - 1 - rank, c)):
            a, b = max(qs.start, lo), min(qs.stop, lo + c)
            if a < b:
                pairs = window_pairs(b - a, nk, chunk * c + a - lo, ks.start, shape)
                if pairs:
                    out.append((b - a, nk, False, pairs))
    return tuple(out)


def ulysses_call_shapes(shape: AttnShape) -> tuple[CallShape, ...]:
    """Ulysses's one call over the whole sequence (heads/P heads), under a window at the
    pairs inside it."""
    n = shape.seq_len
    if shape.band is None:
        return ((n, n, shape.causal),)
    return ((n, n, False, window_pairs(n, n, 0, 0, shape)),)


def call_work(shapes: tuple[CallShape, ...]) -> tuple:
    """((full pairs, causal pairs, causal rows) per (batch, head), calls, ``shapes``); a
    windowed call counts the pairs in its band (a kernel skips the tiles outside it)."""
    full = sum(sh[3] if len(sh) > 3 else sh[0] * sh[1] for sh in shapes if not sh[2])
    diag = sum(sh[0] * (sh[0] + 1) // 2 for sh in shapes if sh[2])
    rows = sum(sh[0] for sh in shapes if sh[2])
    return (full, diag, rows), len(shapes), tuple(sh[:3] for sh in shapes)


@lru_cache(maxsize=256)
def startrail_work(
    lay: StarTrailLayout,
    causal: bool,
    s_local: int,
    packed: PackedLayout | None = None,
    varlen: bool = False,
    window: tuple[int | None, int | None] | None = None,
    own_first: bool = False,
) -> tuple:
    """[step][rank] -> ``call_work`` of that rank's calls at that step. ``varlen``: packed
    documents on a variable-length kernel, whose calls are the grouped ones
    (``StepPlan.varlen``: the same pairs in fewer calls); ``window``: a
    normalized sliding window (``AttnShape.band``); ``own_first``: the first step split as
    ``startrail_call_shapes`` says."""
    steps = startrail_call_shapes(lay, causal, s_local, packed, window, own_first)
    out = []
    for step, row in enumerate(steps):
        works = []
        for r, calls in enumerate(row):
            pairs, n, shapes = call_work(calls)
            if varlen and packed is not None:
                plan = _plan(lay, r, step, causal, s_local, packed, window, own_first, True)
                n = len(plan.varlen)
            works.append((pairs, n, shapes))
        out.append(tuple(works))
    return tuple(out)


def kv_stream_bytes(
    nq: int,
    nk: int,
    causal: bool,
    *,
    cache_bytes: float,
    q_blocks: tuple[tuple[int, int], ...],
    batch: int,
    heads_q: int,
    head_dim: int,
    elem_bytes: int,
    grad_bytes: int,
    bwd: bool,
) -> float:
    """Bytes one kernel call re-streams because its per-head K,V do not fit in the cache.

    A flash-style kernel walks, for each query block of each (batch, q head), over all
    the key blocks. When one head's K,V (forward) or K,V,dK,dV (backward; dK,dV of
    ``grad_bytes`` per element: PyTorch's CPU kernel keeps them in the input dtype)
    exceed ``cache_bytes``, every query block reads them again from further away: K and
    V once per query block forward; K, V read and dK, dV read and written backward.
    ``q_blocks``: the kernel's query block size by query length
    (``ClusterSpec.kernel_q_blocks``). A causal diagonal call touches half the key blocks
    on average (an upper bound: early query blocks stop at their own keys). 0 when the
    term is off (no cache size or blocks), the call is empty or the working set fits.
    """
    if not cache_bytes or not q_blocks or nq <= 0 or nk <= 0:
        return 0.0
    kv = nk * head_dim * elem_bytes  # one head's K (or V)
    dkv = nk * head_dim * grad_bytes
    if (2 * kv + (2 * dkv if bwd else 0)) <= cache_bytes:
        return 0.0
    block = next((b for lo, b in q_blocks if nq >= lo), q_blocks[-1][1])
    passes = batch * heads_q * -(-nq // min(block, nq))
    per_pass = 2 * kv + (4 * dkv if bwd else 0)
    return passes * per_pass * (0.5 if causal else 1.0)


def kernel_time(
    cl: ClusterSpec,
    shape: AttnShape,
    pairs: tuple[int, int, int],
    calls: int,
    bwd: bool,
    shapes: tuple[tuple[int, int, bool], ...] = (),
) -> float:
    """Kernel time of (full pairs, causal-diagonal pairs, causal rows) in ``calls`` calls.

    A causal call also computes the masked part of its diagonal tiles:
    ``causal_tile_waste`` extra pairs per query row. ``shapes``: the calls' (q rows,
    kv rows, causal), for the K,V re-streaming of calls too long for the cache
    (``kv_stream_bytes``, at ``kv_stream_bw`` / ``kv_stream_bw_bwd``).
    """
    per_pair = 4 * shape.head_dim * shape.heads_q * shape.batch
    full, diag, rows = pairs
    work = full + diag + rows * cl.causal_tile_waste
    t = calls * cl.kernel_overhead + per_pair * work / cl.attn_flops
    t = t * cl.attn_bwd_ratio if bwd else t
    bw = cl.kv_stream_bw_bwd if bwd else cl.kv_stream_bw
    if bw and shapes:
        dims = dict(
            cache_bytes=cl.kernel_cache_bytes,
            q_blocks=cl.kernel_q_blocks,
            batch=shape.batch,
            heads_q=shape.heads_q,
            head_dim=shape.head_dim,
            elem_bytes=shape.elem_bytes,
            grad_bytes=shape.elem_bytes,
            bwd=bwd,
        )
        t += sum(kv_stream_bytes(nq, nk, cz, **dims) for nq, nk, cz in shapes) / bw
    return t
