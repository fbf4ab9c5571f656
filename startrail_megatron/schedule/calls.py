"""Kernel calls on rows of the team buffers: dense, per packed document, grouped for varlen.

Pure arithmetic, no torch. ``blocks.py`` plans a (Q team, KV team) block in chunk units;
here the plan becomes ``RowCall`` s on the rows the attention slices (its team's queries,
the K,V team held at a step), and ``VarlenCall`` s for kernels that take many sequences
in one call (flash-attn's varlen functions, TE's THD format). Sliding windows add
``RowCall`` s with a band (``windows.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .blocks import startrail_step_calls, team_block_calls, team_chunk_len
from .layout import StarTrailLayout
from .packing import PackedLayout

__all__ = [
    "RowCall",
    "VarlenCall",
    "band_pairs",
    "packed_team_order",
    "startrail_step_rows",
    "startrail_step_varlen",
]

Band = tuple["int | None", "int | None"]
"""``(lo, hi)`` on a call's local ``j - i`` (``None``: unbounded)."""


def band_pairs(nq: int, nk: int, lo: int | None, hi: int | None) -> int:
    """(query, key) pairs of an nq x nk call inside the band ``lo <= j - i <= hi``."""
    total = 0
    for i in range(nq):
        a = 0 if lo is None else max(0, i + lo)
        b = nk - 1 if hi is None else min(nk - 1, i + hi)
        total += max(0, b - a + 1)
    return total


@dataclass(frozen=True)
class RowCall:
    """One kernel call on team-buffer rows ``[q_lo, q_hi) x [kv_lo, kv_hi)``.

    ``causal``: the top-left causal mask on equal ranges (a diagonal block). ``band``:
    a sliding-window call (``windows.py``), whose rows are each contiguous in the global
    sequence: query i and key j of the call (0-based) form a pair iff
    ``lo <= j - i <= hi``; ``None`` for a plain call. A band call is never ``causal``
    (the causal mask is part of its band).
    """

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int
    causal: bool = False
    band: Band | None = None

    @property
    def q_rows(self) -> slice:
        return slice(self.q_lo, self.q_hi)

    @property
    def kv_rows(self) -> slice:
        return slice(self.kv_lo, self.kv_hi)

    @property
    def nq(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def nk(self) -> int:
        return self.kv_hi - self.kv_lo

    def pairs(self) -> int:
        """The (query, key) pairs the call computes (a causal diagonal counted once)."""
        if self.band is not None:
            return band_pairs(self.nq, self.nk, *self.band)
        return self.nq * (self.nq + 1) // 2 if self.causal else self.nq * self.nk


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
        RowCall(k.q_lo * c, k.q_hi * c, k.kv_lo * c, k.kv_hi * c, k.causal)
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
    """Per call of the team block plan, per document: its clipped ``RowCall`` or None."""
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
            out[i].append(RowCall(q_lo, q_hi, kv_lo, kv_hi, k.causal) if ok else None)
    return tuple(tuple(x) for x in out)


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
                    rows[0].causal,
                    tuple((r.q_lo, r.q_hi) for r in rows),
                    tuple((r.kv_lo, r.kv_hi) for r in rows),
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
