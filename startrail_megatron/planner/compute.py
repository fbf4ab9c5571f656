"""Kernel time: the kernel calls each rank makes, and what one call costs.

The calls are those the implementations make (``block_plan.startrail_step_rows``
on the StarTrail schedule, dense or per packed document, and
``block_plan.allgather_calls``), so causal balance, the diagonal blocks and the
calls skipped between documents are counted exactly. A call costs a fixed overhead plus its
(q, k) pairs at ``attn_flops`` (the masked part of causal diagonal tiles
included), times ``attn_bwd_ratio`` in the backward, plus the K,V re-streaming of
calls too long for the cache (``kv_stream_bytes``).
"""

from __future__ import annotations

from functools import lru_cache

from ..block_plan import (
    allgather_calls,
    band_pairs,
    offset_band,
    own_team_rows,
    split_own_rows,
    startrail_active_steps,
    startrail_step_packed_window_rows,
    startrail_step_rows,
    startrail_step_varlen,
    startrail_step_window_rows,
)
from ..layout import StarTrailLayout
from ..packing import PackedLayout
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


def _step_calls(lay, r, step, causal, s_local, packed, window) -> tuple:
    """Rank r's ``RowCall`` / ``WindowCall`` tuple at ``step`` (``RankContext.step_calls``)."""
    if window is None:
        return startrail_step_rows(lay, r, step, causal, s_local, packed)
    if packed is not None:
        return startrail_step_packed_window_rows(lay, r, step, causal, packed, window)
    return startrail_step_window_rows(lay, r, step, causal, s_local, window)


def _shape(call: tuple) -> CallShape:
    a, b, c, d = call[:4]
    if len(call) == 6:
        return (b - a, d - c, False, band_pairs(b - a, d - c, call[4], call[5]))
    return (b - a, d - c, call[4])


@lru_cache(maxsize=256)
def _first_splits(lay, causal, s_local, packed, window, own_first) -> tuple:
    """[rank] -> (the first step it computes, its own-row calls, the other calls) where
    the attention splits that step (``split_own_rows``: C > 1, dense, ``own_first``;
    dropout, which the planner does not model, would keep it whole), else None."""
    if not own_first or lay.team_size == 1 or packed is not None:
        return (None,) * lay.cp_size
    active = startrail_active_steps(lay, causal, s_local, window, None)
    out = []
    for r in range(lay.cp_size):
        first = lay.computed_steps(r, active)[0]
        calls = _step_calls(lay, r, first, causal, s_local, None, window)
        own, rest = split_own_rows(calls, own_team_rows(lay, r, causal, s_local))
        out.append((first, tuple(c for c, _ in own), rest))
    return tuple(out)


@lru_cache(maxsize=256)
def startrail_call_shapes(
    lay: StarTrailLayout,
    causal: bool,
    s_local: int,
    packed: PackedLayout | None = None,
    window: tuple[int | None, int | None] | None = None,
    own_first: bool = False,
) -> tuple[tuple[tuple[CallShape, ...], ...], ...]:
    """[step][rank] -> the calls the attention makes (``block_plan.startrail_step_rows``,
    dense or per packed document; under a normalized ``window`` the banded calls of
    ``startrail_step_window_rows`` with their pairs), in tokens. ``own_first`` (where the
    attention's ``RankContext.split_first`` is true): the first step a rank computes is
    split as the attention runs it, its own query rows first (``startrail_own_shapes``),
    then the others (the same pairs, more calls)."""
    splits = _first_splits(lay, causal, s_local, packed, window, own_first)
    out = []
    for step in range(lay.ring_size):
        row = []
        for r in range(lay.cp_size):
            split = splits[r]
            if split is not None and split[0] == step:
                calls = split[1] + split[2]
            else:
                calls = _step_calls(lay, r, step, causal, s_local, packed, window)
            row.append(tuple(_shape(c) for c in calls))
        out.append(tuple(row))
    return tuple(out)


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
    splits = _first_splits(lay, causal, s_local, packed, window, own_first)
    return tuple(() if x is None else tuple(_shape(c) for c in x[1]) for x in splits)


def window_pairs(nq: int, nk: int, q0: int, k0: int, shape: AttnShape) -> int:
    """(query, key) pairs of a call on global queries [q0, q0 + nq) and keys [k0, k0 + nk)
    inside ``shape``'s window (and its causal mask)."""
    return band_pairs(nq, nk, *offset_band(k0 - q0, shape.band, shape.causal))


def allgather_call_shapes(rank: int, shape: AttnShape) -> tuple[CallShape, ...]:
    """The calls of ``block_plan.allgather_calls``, in tokens; under a window each counts
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
    (``block_plan.startrail_step_varlen``: the same pairs in fewer calls); ``window``: a
    normalized sliding window (``AttnShape.band``); ``own_first``: the first step split as
    ``startrail_call_shapes`` says."""
    steps = startrail_call_shapes(lay, causal, s_local, packed, window, own_first)
    out = []
    for step, row in enumerate(steps):
        works = []
        for r, calls in enumerate(row):
            pairs, n, shapes = call_work(calls)
            if varlen and packed is not None:
                n = len(startrail_step_varlen(lay, r, step, causal, packed))
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
