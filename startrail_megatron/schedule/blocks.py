"""The causal block plan: which kernel calls one (Q team, KV team) block needs.

Pure arithmetic, no torch. A team's buffer holds its zigzag chunks in ascending
chunk-id order (``StarTrailLayout.team_chunks``). Chunk pair (i, j) of query chunk i
and key chunk j is fully visible when j < i, causal on the diagonal when j == i, and
masked when j > i. ``calls.py`` turns these chunk-unit calls into rows of the team
buffers; ``step.plan_step`` is what a rank runs at a sub-ring step.

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

from .layout import StarTrailLayout

__all__ = [
    "BlockCall",
    "plan_block",
    "startrail_step_calls",
    "team_block_calls",
    "team_chunk_len",
]


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
