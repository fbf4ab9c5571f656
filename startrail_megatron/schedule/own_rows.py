"""Own-row geometry: where a rank's own query rows sit in its team's buffer, and a step's
calls cut at them.

Pure arithmetic, no torch. The first computed step can run the calls on the rank's own
query rows before the team's gather has arrived (they need only the local queries, or
output gradients): the same (query, key) pairs in a few more, smaller calls
(``policies.splits_first_step`` says when).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .calls import RowCall
from .layout import StarTrailLayout
from .windows import band_call

__all__ = ["OwnCall", "OwnRun", "own_team_rows", "restrict_rows", "split_own_rows"]


OwnRun = tuple[int, int, int]
"""(team row lo, team row hi, local row lo): rows of the team buffer that hold this rank's
own queries, and where they start in its local tensors."""


@lru_cache(maxsize=4096)
def own_team_rows(
    layout: StarTrailLayout, rank: int, causal: bool, s_local: int
) -> tuple[OwnRun, ...]:
    """Where ``rank``'s own ``s_local`` rows sit in its team's buffer (dense, in the order
    ``TeamOrder.to_team`` gives, windowed or not): under the causal mask its
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


def restrict_rows(call: RowCall, lo: int, hi: int) -> tuple[RowCall, ...]:
    """``call`` on its query rows inside [lo, hi) only: the same (query, key) pairs of
    those rows, in at most two calls. A causal (square, top-left) call's rows [a, b) see
    its first a keys fully and the next b - a causally; a band call keeps its band,
    shifted to the new first row, trimmed (``windows.band_call``)."""
    a, b = max(lo, call.q_lo), min(hi, call.q_hi)
    if a >= b:
        return ()
    d0, d1 = a - call.q_lo, b - call.q_lo
    ka, kb = call.kv_lo, call.kv_hi
    if call.band is not None:  # local j - i grows by d0 when rows start d0 later
        blo, bhi = call.band
        piece = band_call(
            a,
            b - a,
            ka,
            kb - ka,
            None if blo is None else blo + d0,
            None if bhi is None else bhi + d0,
        )
        return () if piece is None else (piece,)
    if not call.causal:
        return (RowCall(a, b, ka, kb),)
    full = (RowCall(a, b, ka, ka + d0),) if d0 > 0 else ()
    return full + (RowCall(a, b, ka + d0, ka + d1, True),)


@dataclass(frozen=True)
class OwnCall:
    """A call on the rank's own query rows: ``call`` on team-buffer rows, whose queries
    sit ``shift`` rows further in the rank's local tensors (``local_q_rows``)."""

    call: RowCall
    shift: int

    @property
    def local_q_rows(self) -> slice:
        return slice(self.call.q_lo + self.shift, self.call.q_hi + self.shift)


def split_own_rows(
    calls: tuple[RowCall, ...], own: tuple[OwnRun, ...]
) -> tuple[tuple[OwnCall, ...], tuple[RowCall, ...]]:
    """A step's calls split by query rows: (the calls on ``own`` rows; the calls on the
    other rows), together exactly the pairs of ``calls``. The first step runs the first
    part while the team's queries (forward) or output gradients (backward) are still
    being gathered: those rows are the rank's own (``attention.py``'s Note [overlap])."""
    mine: list[OwnCall] = []
    rest: list[RowCall] = []
    for call in calls:
        edge = call.q_lo
        for lo, hi, local in own:
            mine.extend(OwnCall(piece, local - lo) for piece in restrict_rows(call, lo, hi))
            rest.extend(restrict_rows(call, edge, lo))
            edge = max(edge, hi)
        rest.extend(restrict_rows(call, edge, call.q_hi))
    return tuple(mine), tuple(rest)
