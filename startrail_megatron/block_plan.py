"""Which kernel calls each rank makes: StarTrail's blocks per sub-ring step, the all-gather peer's.

Pure arithmetic, no torch. The one place that decides the kernel calls:
``startrail_step_calls`` (rank r at sub-ring step s) is what ``attention.py``
runs and what the planner counts; ``allgather_calls`` likewise for the
all-gather-KV peer (``peers/allgather.py``). A team's buffer holds its zigzag chunks in
ascending chunk-id order (``StarTrailLayout.team_chunks``). Chunk pair
(i, j) of query chunk i and key chunk j is fully visible when j < i, causal
on the diagonal when j == i, and masked when j > i.

Note [causal balance]
---------------------
With the team placement, team t holds the front chunks [tC, tC+C) and the
back chunks [2P-C-tC, 2P-tC): the buffer is [fronts, backs]. A block is then
at most three calls, never one that is fully masked:

            KV team earlier        KV team later          own team
            kv: F      B           kv: F      B           kv: F       B
  q: F     [ full ]   .       q: F   .        .      q: F [causal]   .
  q: B     [ full ]   .       q: B [ full    full ]  q: B [ full ] [causal]

"earlier": all q rows against the KV fronts; "later": the q backs against
all KV; both are exactly n*n/2 (q, k) pairs for n team tokens. The own-team
block has n/2 pairs more (its two diagonals), once per team, so causal work
is equal on every rank up to that diagonal term. With the ring placement the
team's chunks are not contiguous; the same rule still gives each off-diagonal
block exactly half its pairs (for zigzag chunks r and 2P-1-r against r' and
2P-1-r', exactly two of the four chunk pairs are visible) in more, smaller
calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .layout import ActiveSteps, StarTrailLayout
from .packing import PackedLayout


@dataclass(frozen=True)
class BlockCall:
    """One kernel call on chunk positions [q_lo, q_hi) x [kv_lo, kv_hi).

    Positions index the team buffers in chunk units. ``causal`` calls have
    equal ranges and use the top-left causal mask (the diagonal block).
    """

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int
    causal: bool

    def pairs(self, chunk_len: int) -> int:
        """(query, key) pairs this call computes for ``chunk_len`` tokens per chunk."""
        nq = (self.q_hi - self.q_lo) * chunk_len
        nk = (self.kv_hi - self.kv_lo) * chunk_len
        return nq * (nq + 1) // 2 if self.causal else nq * nk


def _intervals(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted positions -> maximal half-open intervals of consecutive ones."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return tuple(out)


def plan_block(q_chunks: list[int], kv_chunks: list[int], causal: bool) -> list[BlockCall]:
    """The kernel calls that compute the block of ``q_chunks`` x ``kv_chunks``.

    Both lists are ascending chunk ids. Without ``causal`` the block is one
    full call. With it, each run of consecutive shared chunk ids is one causal
    call, and the remaining visible pairs are grouped into full calls on
    contiguous ranges (query positions with identical visible key ranges are
    merged). No call is ever fully masked; every visible pair is covered once.
    """
    nq, nk = len(q_chunks), len(kv_chunks)
    if not causal:
        return [BlockCall(0, nq, 0, nk, False)]
    kv_pos = {c: j for j, c in enumerate(kv_chunks)}
    calls: list[BlockCall] = []
    covered: set[tuple[int, int]] = set()
    # Diagonal runs: q positions i..i+m whose ids are consecutive and present
    # at consecutive kv positions.
    diag = [(i, kv_pos[c]) for i, c in enumerate(q_chunks) if c in kv_pos]
    run: list[tuple[int, int]] = []
    for i, j in diag + [(-2, -2)]:
        if (
            run
            and i == run[-1][0] + 1
            and j == run[-1][1] + 1
            and q_chunks[i] == q_chunks[run[-1][0]] + 1
        ):
            run.append((i, j))
            continue
        if run:
            (i0, j0), m = run[0], len(run)
            calls.append(BlockCall(i0, i0 + m, j0, j0 + m, True))
            covered.update((i0 + x, j0 + y) for x in range(m) for y in range(x + 1))
        run = [(i, j)]
    # Fully visible pairs not inside a causal call.
    rows: list[tuple[tuple[int, int], ...]] = []
    for i, qc in enumerate(q_chunks):
        vis = [j for j, kc in enumerate(kv_chunks) if kc < qc and (i, j) not in covered]
        rows.append(_intervals(vis))
    i = 0
    while i < nq:
        end = i + 1
        while end < nq and rows[end] == rows[i]:
            end += 1
        calls.extend(BlockCall(i, end, lo, hi, False) for lo, hi in rows[i])
        i = end
    return calls


# ---- StarTrail: the calls of rank r at sub-ring step s ------------------------------
@lru_cache(maxsize=4096)
def team_block_calls(
    layout: StarTrailLayout, q_team: int, kv_team: int, causal: bool
) -> tuple[BlockCall, ...]:
    """The calls of the (``q_team``, ``kv_team``) block on team buffers (cached).

    Causal: ``plan_block`` on the two teams' zigzag chunks; full: one call on
    the whole buffers (a single chunk, see ``team_chunk_len``).
    """
    if not causal:
        return tuple(plan_block([0], [0], False))
    return tuple(plan_block(layout.team_chunks(q_team), layout.team_chunks(kv_team), True))


def startrail_step_calls(
    layout: StarTrailLayout, rank: int, step: int, causal: bool
) -> tuple[BlockCall, ...]:
    """The kernel calls ``rank`` makes at sub-ring step ``step``: its team's queries
    against the KV team it holds then (``StarTrailLayout.kv_team_at_step``)."""
    team = layout.coord(rank)[0]
    return team_block_calls(layout, team, layout.kv_team_at_step(rank, step), causal)


def team_chunk_len(layout: StarTrailLayout, s_local: int, causal: bool) -> int:
    """Tokens per chunk unit of ``BlockCall`` positions: a zigzag chunk (``s_local/2``)
    under the causal mask, the whole team buffer (``C * s_local``) without it."""
    return s_local // 2 if causal else layout.team_size * s_local


# ---- rows: what the attention loops slice ---------------------------------------------
RowCall = tuple[int, int, int, int, bool]
"""(q_lo, q_hi, kv_lo, kv_hi, causal): one kernel call on team-buffer rows."""


def startrail_step_rows(
    layout: StarTrailLayout,
    rank: int,
    step: int,
    causal: bool,
    s_local: int,
    packed: PackedLayout | None = None,
) -> tuple[RowCall, ...]:
    """The kernel calls of ``rank`` at sub-ring step ``step``, on rows of the team buffers
    (its team's queries, the held KV team), in the order the attention makes them.

    Dense: ``startrail_step_calls`` scaled by ``team_chunk_len``. Packed documents
    (Note [packed documents under StarTrail] in ``packing.py``): per document, the same
    block plan scaled by that document's chunk length (the whole team part of the document
    for full attention), offset to the document and clipped to the real tokens of the Q and
    KV teams; calls left empty are not made (no pair of the same document).
    """
    if packed is None:
        return _dense_rows(layout, rank, step, causal, s_local)
    return _packed_rows(layout, rank, step, causal, packed)


@lru_cache(maxsize=4096)
def _dense_rows(layout, rank, step, causal, s_local) -> tuple[RowCall, ...]:
    c = team_chunk_len(layout, s_local, causal)
    return tuple(
        (k.q_lo * c, k.q_hi * c, k.kv_lo * c, k.kv_hi * c, k.causal)
        for k in startrail_step_calls(layout, rank, step, causal)
    )


# Packed layouts change with every batch: a small cache (the steps and the backward of the
# batch in flight, and the planner's ranks), never one that grows with the training run.
@lru_cache(maxsize=512)
def _packed_rows(layout, rank, step, causal, packed) -> tuple[RowCall, ...]:
    per_call = _packed_rows_per_call(layout, rank, step, causal, packed)
    return tuple(row for doc_rows in zip(*per_call) for row in doc_rows if row is not None)


@lru_cache(maxsize=512)
def _packed_rows_per_call(layout, rank, step, causal, packed):
    """Per call of the team block plan, per document: its clipped row call or None."""
    team = layout.coord(rank)[0]
    kv_team = layout.kv_team_at_step(rank, step)
    calls = team_block_calls(layout, team, kv_team, causal)
    q_chunks, kv_chunks = layout.team_chunks(team), layout.team_chunks(kv_team)
    cc = layout.team_size
    out: list[list[RowCall | None]] = [[] for _ in calls]
    for d in range(packed.num_docs):
        c = packed.chunk_len(d)
        unit = c if causal else 2 * cc * c
        base = cc * packed.local_offsets[d]  # the same in every team's buffer
        q_end = base + packed.real_in_chunks(d, q_chunks)
        kv_end = base + packed.real_in_chunks(d, kv_chunks)
        for i, k in enumerate(calls):
            q_lo, kv_lo = base + k.q_lo * unit, base + k.kv_lo * unit
            q_hi, kv_hi = min(base + k.q_hi * unit, q_end), min(base + k.kv_hi * unit, kv_end)
            ok = q_hi > q_lo and kv_hi > kv_lo  # empty documents and padding: no call
            out[i].append((q_lo, q_hi, kv_lo, kv_hi, k.causal) if ok else None)
    return tuple(tuple(x) for x in out)


# ---- sliding windows: calls on globally contiguous runs, with a band ---------------------
WindowCall = tuple[int, int, int, int, "int | None", "int | None"]
"""(q_lo, q_hi, kv_lo, kv_hi, band_lo, band_hi): one kernel call on team-buffer rows whose
query and key rows are each contiguous in the global sequence; query i and key j of the
call (0-based) form a pair iff ``band_lo <= j - i <= band_hi`` (``None``: unbounded)."""


def _buffer_chunks(layout: StarTrailLayout, team: int, causal: bool) -> list[int]:
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


def _band_call(qa, nq, ka, nk, lo, hi) -> WindowCall | None:
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
    return (
        qa + r0,
        qa + r1 + 1,
        ka + c0,
        ka + c1 + 1,
        None if lo is None else lo - shift,
        None if hi is None else hi - shift,
    )


def _chunk_pair_calls(q_chunks, kv_chunks, c: int, base: int, n: int, window, causal: bool):
    """The band calls of one sequence (a dense one, or one packed document) in two team
    buffers that hold its chunks ``q_chunks`` / ``kv_chunks`` (zigzag ids, in buffer
    order) of ``c`` tokens from row ``base`` on: per (query chunk, key chunk) pair, the
    band of their offset, clipped to the ``n`` real tokens (padding ends the sequence) and
    trimmed (``_band_call``); pairs with nothing in the window give no call. A generator:
    ``_has_window_call`` stops at the first call."""
    for qi, qc in enumerate(q_chunks):
        nq = min(max(n - qc * c, 0), c)
        for ki, kc in enumerate(kv_chunks):
            nk = min(max(n - kc * c, 0), c)
            if nq == 0 or nk == 0:
                continue
            lo, hi = offset_band((kc - qc) * c, window, causal)
            call = _band_call(base + qi * c, nq, base + ki * c, nk, lo, hi)
            if call is not None:
                yield call


def _window_calls(layout, rank, step, causal, s_local, window, packed):
    """The band calls of ``rank`` at ``step`` (a generator): dense, the team buffers in
    buffer order (``_buffer_chunks``) as one sequence; packed, per document the teams'
    chunks in ascending order (``packed_team_order``) from the document's rows on, the
    window counting positions inside the document."""
    team, kv_team = layout.coord(rank)[0], layout.kv_team_at_step(rank, step)
    if packed is None:
        q_chunks, kv_chunks = (
            _buffer_chunks(layout, team, causal),
            _buffer_chunks(layout, kv_team, causal),
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
) -> tuple[WindowCall, ...]:
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
) -> tuple[WindowCall, ...]:
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


def band_pairs(nq: int, nk: int, lo: int | None, hi: int | None) -> int:
    """(query, key) pairs of an nq x nk call inside the band ``lo <= j - i <= hi``."""
    total = 0
    for i in range(nq):
        a = 0 if lo is None else max(0, i + lo)
        b = nk - 1 if hi is None else min(nk - 1, i + hi)
        total += max(0, b - a + 1)
    return total


@dataclass(frozen=True)
class VarlenCall:
    """One variable-length kernel call (flash-attn's varlen functions, TE's THD format):
    the same call of the team block plan for every document, as one batch of sequences.

    ``q_segments[i]`` and ``kv_segments[i]`` are team-buffer rows ``[lo, hi)`` of the
    i-th sequence; ``causal`` sequences have equal lengths (top-left and bottom-right
    causal masks agree).
    """

    causal: bool
    q_segments: tuple[tuple[int, int], ...]
    kv_segments: tuple[tuple[int, int], ...]


@lru_cache(maxsize=512)
def startrail_step_varlen(
    layout: StarTrailLayout, rank: int, step: int, causal: bool, packed: PackedLayout
) -> tuple[VarlenCall, ...]:
    """The packed calls of ``startrail_step_rows`` grouped for a variable-length kernel:
    one ``VarlenCall`` per call of the team block plan (at most three with the team
    placement), holding that call's rows of every document. The same (q, k) pairs as
    the rows, in fewer, larger kernel calls."""
    out = []
    for rows in _packed_rows_per_call(layout, rank, step, causal, packed):
        rows = [r for r in rows if r is not None]
        if rows:
            out.append(
                VarlenCall(
                    rows[0][4],
                    tuple((r[0], r[1]) for r in rows),
                    tuple((r[2], r[3]) for r in rows),
                )
            )
    return tuple(out)


@lru_cache(maxsize=8)  # one team per rank and batch; each entry holds C * s_local ints
def packed_team_order(layout: StarTrailLayout, team: int, packed: PackedLayout) -> tuple[int, ...]:
    """Row permutation from a team's all-gathered buffer (members in order, each its local
    buffer) to the team buffer (per document, the team's chunks in ascending order):
    ``team_buffer = gathered[order]``."""
    p, s_local = layout.cp_size, packed.s_local
    members = layout.team_ranks(team)
    order: list[int] = []
    for d in range(packed.num_docs):
        c, off = packed.chunk_len(d), packed.local_offsets[d]
        pieces = []  # (chunk id, first gathered row)
        for m, r in enumerate(members):
            for half, j in enumerate((r, 2 * p - 1 - r)):
                pieces.append((j, m * s_local + off + half * c))
        for _, first in sorted(pieces):
            order.extend(range(first, first + c))
    return tuple(order)


# ---- the all-gather-KV peer ------------------------------------------------------------
def allgather_calls(
    rank: int, cp_size: int, causal: bool, s_local: int
) -> list[tuple[slice, slice, bool]]:
    """Kernel calls of one all-gather-KV rank: (local q rows, rows of the natural-order
    gathered KV, causal).

    Causal, for CP rank r with zigzag chunks r and 2P-1-r (c tokens per chunk)::

        q chunk r        : full against chunks [0, r)        + causal on chunk r
        q chunk 2P-1-r   : full against chunks [0, 2P-1-r)   + causal on chunk 2P-1-r

    so every rank computes the same number of (q, k) pairs. Full: one call.
    """
    p = cp_size
    if not causal:
        return [(slice(0, s_local), slice(0, p * s_local), False)]
    c = s_local // 2
    out = []
    for half, chunk in ((0, rank), (1, 2 * p - 1 - rank)):
        qs = slice(half * c, (half + 1) * c)
        if chunk > 0:
            out.append((qs, slice(0, chunk * c), False))
        out.append((qs, slice(chunk * c, (chunk + 1) * c), True))
    return out


# ---- the last step by head groups ---------------------------------------------------------
def tail_head_groups(
    layout: StarTrailLayout, heads_q: int, heads_kv: int, dropout: bool
) -> tuple[tuple[slice, slice], ...]:
    """The (q heads, kv heads) groups the last sub-ring step runs one after the other, so
    the team collectives of one (the forward's lse and out, the backward's dq) overlap the
    next one's compute (``attention.py``'s Note [overlap]; the same calls, each on fewer
    heads).

    Two groups when there is a team combine (C > 1), a sub-ring (G > 1) and at least two
    query heads: the KV heads split in halves with their query heads (GQA groups stay
    whole), or with one KV head the query heads in halves. One group (all heads)
    otherwise. With dropout: a call's mask is drawn for all its heads, and the backward
    replays it whole. At G = 1 the one step is the whole computation: run by head groups,
    its head-sliced operands cost kernels that need contiguous inputs (the reference, TE)
    copies at the backward's peak, about 3 A at P = 4, C = 2 (``tests/test_memory.py``),
    more than hiding half the combine is worth; the last step of G > 1 holds no next K,V,
    which leaves room for them."""
    every = ((slice(0, heads_q), slice(0, heads_kv)),)
    if layout.team_size == 1 or layout.ring_size == 1 or heads_q < 2 or dropout:
        return every
    if heads_kv >= 2:
        per, k1 = heads_q // heads_kv, heads_kv // 2
        return ((slice(0, k1 * per), slice(0, k1)), (slice(k1 * per, heads_q), slice(k1, heads_kv)))
    h1 = heads_q // 2
    return ((slice(0, h1), slice(0, 1)), (slice(h1, heads_q), slice(0, 1)))


# ---- the first step: this rank's own query rows first ------------------------------------
OwnRun = tuple[int, int, int]
"""(team row lo, team row hi, local row lo): rows of the team buffer that hold this rank's
own queries, and where they start in its local tensors."""


@lru_cache(maxsize=4096)
def own_team_rows(
    layout: StarTrailLayout, rank: int, causal: bool, s_local: int
) -> tuple[OwnRun, ...]:
    """Where ``rank``'s own ``s_local`` rows sit in its team's buffer (dense, in the order
    ``RankContext.to_team_order`` gives, windowed or not): under the causal mask its
    chunks r and 2P-1-r at their places in the ascending chunk order
    (``StarTrailLayout.team_chunks``), without it its member block. Adjacent runs merged."""
    team, m = layout.coord(rank)
    if not causal:
        return ((m * s_local, (m + 1) * s_local, 0),)
    c, p = s_local // 2, layout.cp_size
    order = layout.team_chunks(team)
    runs: list[OwnRun] = []
    for half, chunk in enumerate((rank, 2 * p - 1 - rank)):
        lo = order.index(chunk) * c
        if runs and runs[-1][1] == lo and runs[-1][2] + runs[-1][1] - runs[-1][0] == half * c:
            runs[-1] = (runs[-1][0], lo + c, runs[-1][2])
        else:
            runs.append((lo, lo + c, half * c))
    return tuple(runs)


OWN_ROWS_FIRST_SETTINGS = {"auto": None, "on": True, "off": False}
"""The words of every own-rows-first setting (Megatron's ``--startrail-own-rows-first``,
DeepSpeed's ``startrail.own_rows_first``, ``$STARTRAIL_OWN_ROWS_FIRST``, the tools'
``--own-rows-first``) -> ``CommOptions(own_rows_first=)``; ``None``: this rule."""


def check_own_rows_first(value, name: str = "own_rows_first") -> bool | None:
    """``value`` when it is True, False or None (auto); else ``ValueError`` naming ``name``."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True, False or None (auto)")
    return value


def own_rows_first_pays(
    layout: StarTrailLayout, heads_q: int, heads_kv: int, team_hosts: int
) -> bool:
    """Whether StarTrail's first step runs its own rows first by default
    (``comm.CommOptions(own_rows_first=None)``); ``team_hosts``: how many hosts the
    rank's team spans (``StarTrailGroups.team_hosts``).

    The team gather (forward: the other members' q, (C-1) local q's; backward: dout and
    delta alike) and the initial placement (C local K,V's received) start together. The
    split hides the gather behind the own rows' calls, so it pays only where the gather
    would still be in flight when the placement has arrived; it costs a few more calls
    everywhere. A team inside one host gathers over the fast links while the placement
    crosses hosts: the gather ends first. A team across hosts gathers over the same kind
    of link as the placement, so it ends later when it carries more bytes: (C-1) *
    heads_q > 2 * C * heads_kv (GQA with few K,V heads). This is the planner's verdict on
    its presets (``startrail-plan --own-rows-first on|off`` prices either; section 11 of
    ``docs/performance.md``)."""
    c = layout.team_size
    if c == 1 or team_hosts < 2:
        return False
    return (c - 1) * heads_q > 2 * c * heads_kv


def restrict_rows(call: tuple, lo: int, hi: int) -> tuple[tuple, ...]:
    """``call`` (a ``RowCall`` or a ``WindowCall``) on its query rows inside [lo, hi) only:
    the same (query, key) pairs of those rows, in at most two calls. A causal (square,
    top-left) call's rows [a, b) see its first a keys fully and the next b - a causally; a
    band call keeps its band, shifted to the new first row, trimmed (``_band_call``)."""
    qa, qb, ka, kb = call[:4]
    a, b = max(lo, qa), min(hi, qb)
    if a >= b:
        return ()
    d0, d1 = a - qa, b - qa
    if len(call) == 6:  # WindowCall: local j - i grows by d0 when rows start d0 later
        blo, bhi = call[4], call[5]
        band = _band_call(
            a,
            b - a,
            ka,
            kb - ka,
            None if blo is None else blo + d0,
            None if bhi is None else bhi + d0,
        )
        return () if band is None else (band,)
    if not call[4]:
        return ((a, b, ka, kb, False),)
    full = ((a, b, ka, ka + d0, False),) if d0 > 0 else ()
    return full + ((a, b, ka + d0, ka + d1, True),)


def split_own_rows(
    calls: tuple[tuple, ...], own: tuple[OwnRun, ...]
) -> tuple[tuple[tuple[tuple, int], ...], tuple[tuple, ...]]:
    """A step's calls split by query rows: (the calls on ``own`` rows, each with the shift
    from team rows to local rows; the calls on the other rows), together exactly the pairs
    of ``calls``. The first step runs the first part while the team's queries (forward) or
    output gradients (backward) are still being gathered: those rows are the rank's own
    (``attention.py``'s Note [overlap])."""
    mine: list[tuple[tuple, int]] = []
    rest: list[tuple] = []
    for call in calls:
        edge = call[0]
        for lo, hi, local in own:
            mine.extend((piece, local - lo) for piece in restrict_rows(call, lo, hi))
            rest.extend(restrict_rows(call, edge, lo))
            edge = max(edge, hi)
        rest.extend(restrict_rows(call, edge, call[1]))
    return tuple(mine), tuple(rest)
