"""Sliding windows: calls on globally contiguous runs, each with its band; idle steps.

Pure arithmetic, no torch. Under a window ``(left, right)`` (normalized: ``None``
unbounded) each (query chunk, key chunk) pair of two team buffers becomes one band call
(``RowCall.band``) trimmed to the rows and keys inside the window, and pairs with nothing
in it give no call: the work the window skips. Sub-ring steps with no call on any rank of
the sub-ring are idle (``startrail_active_steps``): their K,V goes straight past them.
"""

from __future__ import annotations

from functools import lru_cache

from .calls import RowCall
from .layout import ActiveSteps, StarTrailLayout
from .packing import PackedLayout

__all__ = [
    "band_call",
    "buffer_chunks",
    "normalize_window",
    "offset_band",
    "startrail_active_steps",
    "startrail_step_packed_window_rows",
    "startrail_step_window_rows",
]


def buffer_chunks(layout: StarTrailLayout, team: int, causal: bool) -> list[int]:
    """Zigzag chunk ids of a team's buffer, in buffer order: ascending under the causal
    mask (``team_chunks``), the all-gathered member order without it."""
    if causal:
        return layout.team_chunks(team)
    p = layout.cp_size
    return [x for r in layout.team_ranks(team) for x in (r, 2 * p - 1 - r)]


def offset_band(off: int, window, causal: bool) -> tuple[int | None, int | None]:
    """The band on local ``j - i`` of a call whose first key sits ``off`` positions after
    its first query: the window ``(left, right)`` (normalized: ``None`` unbounded), and
    the causal mask's ``j <= i`` (also the planner's pair counts, ``planner/compute.py``)."""
    left, right = window
    lo = None if left is None else -left - off
    hi = None if right is None else right - off
    if causal:
        hi = -off if hi is None else min(hi, -off)
    return lo, hi


def band_call(qa: int, nq: int, ka: int, nk: int, lo, hi) -> RowCall | None:
    """The call on rows [qa, qa+nq) x [ka, ka+nk) with band (lo, hi), trimmed to the rows
    that see at least one key and the keys that at least one row sees (so every row of
    the call has a key: no empty softmax rows, and flash-attn's window sizes are >= 0);
    ``None`` when no pair is in the band."""
    if lo is not None and hi is not None and lo > hi:
        return None
    r0 = 0 if hi is None else max(0, -hi)
    r1 = nq - 1 if lo is None else min(nq - 1, nk - 1 - lo)
    if r0 > r1:
        return None
    c0 = 0 if lo is None else max(0, r0 + lo)
    c1 = nk - 1 if hi is None else min(nk - 1, r1 + hi)
    if c0 > c1:
        return None
    shift = c0 - r0  # local j - i = j' - i' + shift
    band = (None if lo is None else lo - shift, None if hi is None else hi - shift)
    return RowCall(qa + r0, qa + r1 + 1, ka + c0, ka + c1 + 1, band=band)


def _chunk_pair_calls(q_chunks, kv_chunks, c: int, base: int, n: int, window, causal: bool):
    """The band calls of one sequence (a dense one, or one packed document) in two team
    buffers that hold its chunks ``q_chunks`` / ``kv_chunks`` (zigzag ids, in buffer
    order) of ``c`` tokens from row ``base`` on: per (query chunk, key chunk) pair, the
    band of their offset, clipped to the ``n`` real tokens (padding ends the sequence) and
    trimmed (``band_call``); pairs with nothing in the window give no call. A generator:
    ``_has_window_call`` stops at the first call."""
    for qi, qc in enumerate(q_chunks):
        nq = min(max(n - qc * c, 0), c)
        for ki, kc in enumerate(kv_chunks):
            nk = min(max(n - kc * c, 0), c)
            if nq == 0 or nk == 0:
                continue
            lo, hi = offset_band((kc - qc) * c, window, causal)
            call = band_call(base + qi * c, nq, base + ki * c, nk, lo, hi)
            if call is not None:
                yield call


def _window_calls(layout, rank, step, causal, s_local, window, packed):
    """The band calls of ``rank`` at ``step`` (a generator): dense, the team buffers in
    buffer order (``buffer_chunks``) as one sequence; packed, per document the teams'
    chunks in ascending order (``packed_team_order``) from the document's rows on, the
    window counting positions inside the document."""
    team, kv_team = layout.coord(rank)[0], layout.kv_team_at_step(rank, step)
    if packed is None:
        q_chunks, kv_chunks = (
            buffer_chunks(layout, team, causal),
            buffer_chunks(layout, kv_team, causal),
        )
        n = layout.cp_size * s_local  # no padding
        yield from _chunk_pair_calls(q_chunks, kv_chunks, s_local // 2, 0, n, window, causal)
        return
    q_chunks, kv_chunks = layout.team_chunks(team), layout.team_chunks(kv_team)
    for d in range(packed.num_docs):
        base = layout.team_size * packed.local_offsets[d]  # the same in every team's buffer
        yield from _chunk_pair_calls(
            q_chunks, kv_chunks, packed.chunk_len(d), base, packed.lengths[d], window, causal
        )


def normalize_window(window, seq_len: int, causal: bool) -> tuple[int | None, int | None] | None:
    """A sliding window ``(left, right)`` (Megatron / flash-attn: ``-1`` unbounded) as
    ``(left, right)`` with ``None`` for sides that mask nothing at ``seq_len`` tokens (the
    right side under the causal mask too), or ``None`` when it masks nothing at all.
    ``ValueError`` naming ``window`` for anything but a pair of integers >= -1."""
    if window is None:
        return None
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    if ok:
        ok = all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in window)
    if not ok:
        raise ValueError(
            f"window={window!r} must be a pair (left, right) of integers >= -1 (-1: unbounded; "
            "(-1, 0) is causal, (W - 1, 0) a causal window of W tokens)"
        )
    left, right = (None if x == -1 or x >= seq_len - 1 else x for x in window)
    if causal:
        right = None  # the causal mask already stops at the diagonal (right >= 0)
    return None if left is None and right is None else (left, right)


@lru_cache(maxsize=512)
def startrail_step_window_rows(
    layout: StarTrailLayout,
    rank: int,
    step: int,
    causal: bool,
    s_local: int,
    window: tuple[int | None, int | None],
) -> tuple[RowCall, ...]:
    """The calls of ``startrail_step_rows`` (dense, zigzag layout) under a sliding window.

    ``window = (left, right)`` in global positions: key j is visible to query i iff
    ``i - left <= j <= i + right`` (``None``: unbounded), and ``j <= i`` too under the
    causal mask. Each (query chunk, key chunk) pair of the two team buffers gets the band
    its global offset gives and is trimmed to the rows and keys inside it
    (``_chunk_pair_calls``); pairs with nothing in the window (those the causal mask hides
    too) are not made: the work the window skips. (More, smaller calls than without a
    window; merging neighbouring chunk pairs for wide windows is not done.)
    """
    return tuple(_window_calls(layout, rank, step, causal, s_local, window, None))


# Packed layouts change with every batch: a small cache, as for ``_packed_rows``.
@lru_cache(maxsize=512)
def startrail_step_packed_window_rows(
    layout: StarTrailLayout,
    rank: int,
    step: int,
    causal: bool,
    packed: PackedLayout,
    window: tuple[int | None, int | None],
) -> tuple[RowCall, ...]:
    """``startrail_step_window_rows`` per packed document: for each document, each (query
    chunk, key chunk) pair of the two teams' buffers (per document the team's chunks in
    ascending order, ``packed_team_order``) with the band its offset inside the document
    gives, clipped to the real tokens (padding ends each document) and trimmed; the
    window counts positions inside the document."""
    return tuple(_window_calls(layout, rank, step, causal, packed.s_local, window, packed))


@lru_cache(maxsize=64)
def startrail_active_steps(
    layout: StarTrailLayout,
    causal: bool,
    s_local: int,
    window: tuple[int | None, int | None] | None = None,
    packed: PackedLayout | None = None,
) -> ActiveSteps | None:
    """The sub-ring steps each sub-ring computes (per ``StarTrailLayout.subring_index``,
    ascending): those at which some rank of the sub-ring makes a kernel call. The others
    are idle on every rank of the sub-ring (the KV held then lies outside every query's
    window), so their KV is not sent either: it goes straight past them
    (``StarTrailLayout.ring_shift``; the placement to the first computed step's holders,
    the dK/dV home from the last one's: ``placement_targets(active=)``,
    ``dkv_home_targets(active=)``). A sub-ring with no call at all computes step 0 only.
    ``None`` (every step) without a window: a dense block plan is never empty, and packed
    documents without a window are not searched for idle steps."""
    if window is None or layout.ring_size == 1:
        return None
    out = []
    for ranks in layout.all_subring_ranks():
        busy = tuple(
            step
            for step in range(layout.ring_size)
            if any(
                _has_window_call(layout, r, step, causal, s_local, window, packed) for r in ranks
            )
        )
        out.append(busy or (0,))
    if all(len(x) == layout.ring_size for x in out):
        return None
    return tuple(out)


def _has_window_call(layout, rank, step, causal, s_local, window, packed) -> bool:
    """Whether ``rank`` makes any call at ``step`` under ``window`` (``_window_calls``,
    stopping at the first; uncached, so other ranks' plans do not evict this rank's)."""
    calls = _window_calls(layout, rank, step, causal, s_local, window, packed)
    return next(calls, None) is not None
