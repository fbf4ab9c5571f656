"""``plan_step``: the one answer to "what does rank r compute at sub-ring step s".

The attention's forward and backward loops (``rank/``) and the planner's cost model
(``planner/compute.py``) both ask this function and nothing else, so a variant (packed
documents, windows, own rows first, varlen grouping) changes one place. Pure, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .calls import RowCall, VarlenCall, startrail_step_rows, startrail_step_varlen
from .layout import StarTrailLayout
from .own_rows import OwnCall, own_team_rows, restrict_rows, split_own_rows
from .packing import PackedLayout
from .windows import startrail_step_packed_window_rows, startrail_step_window_rows

__all__ = ["StepPlan", "check_tile", "plan_step", "tile_calls"]


@dataclass(frozen=True)
class StepPlan:
    """A rank's kernel calls at one sub-ring step, at most one of ``varlen`` and
    ``rows`` non-empty.

    ``varlen``: packed documents on a kernel with variable-length methods, one grouped
    call per block-plan call. ``rows``: one call per row block (dense, per document, or
    banded under a window). ``own``: where the step is split (``own_first``), the calls
    on the rank's own query rows, run first; ``rows`` then hold the other rows.
    """

    varlen: tuple[VarlenCall, ...] = ()
    rows: tuple[RowCall, ...] = ()
    own: tuple[OwnCall, ...] = ()

    @property
    def row_calls(self) -> tuple[RowCall, ...]:
        """Every row call in the order they run: the own rows' first, then the rest."""
        return tuple(o.call for o in self.own) + self.rows


def plan_step(
    layout: StarTrailLayout,
    rank: int,
    step: int,
    *,
    causal: bool,
    s_local: int,
    packed: PackedLayout | None = None,
    window: tuple[int | None, int | None] | None = None,
    varlen: bool = False,
    own_first: bool = False,
    tile: int | None = None,
) -> StepPlan:
    """The calls ``rank`` makes at sub-ring ``step``.

    ``window``: a normalized sliding window (``windows.normalize_window``); ``varlen``:
    the kernel has variable-length methods (used for packed documents without a window);
    ``own_first``: split the step's calls at the rank's own query rows
    (``policies.splits_first_step`` decides it, for the first computed step only; dense
    rows only); ``tile``: every row call cut into calls of at most ``tile`` query rows
    (``tile_calls``; varlen calls stay whole). Not cached itself: the row calls it picks
    from are."""
    if own_first and packed is not None:
        raise ValueError("own_first splits dense rows only: packed documents keep whole calls")
    if packed is not None and window is None and varlen:
        return StepPlan(varlen=startrail_step_varlen(layout, rank, step, causal, packed))
    if window is None:
        calls = startrail_step_rows(layout, rank, step, causal, s_local, packed)
    elif packed is not None:
        calls = startrail_step_packed_window_rows(layout, rank, step, causal, packed, window)
    else:
        calls = startrail_step_window_rows(layout, rank, step, causal, s_local, window)
    if not own_first:
        return StepPlan(rows=tile_calls(calls, tile))
    own, rest = split_own_rows(calls, own_team_rows(layout, rank, causal, s_local))
    own = tuple(OwnCall(p, o.shift) for o in own for p in tile_calls((o.call,), tile))
    return StepPlan(rows=tile_calls(rest, tile), own=own)


def check_tile(tile, name: str = "tile") -> int | None:
    """``tile`` checked: None or an integer >= 1 (``ValueError`` naming ``name``)."""
    if tile is None:
        return None
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"{name}={tile!r} must be None (whole calls) or an integer >= 1 (tokens)")
    return tile


def check_head_chunks_setting(n, name: str = "--startrail-attention-head-chunks") -> int | None:
    """A head-chunk setting before the heads are known: None or an integer >= 1
    (``ValueError`` naming ``name``); ``validation.check_head_chunks`` checks it against the
    KV heads at each call."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} {n!r} must be an integer >= 1 (None: all heads at once)")
    return n


def tile_calls(calls: tuple[RowCall, ...], tile: int | None) -> tuple[RowCall, ...]:
    """``calls`` cut into tiles: the same (query, key) pairs in calls of at most ``tile``
    query rows and, but for band calls, at most ``tile`` key rows. A causal call's row
    tile is a causal square on the diagonal and full tiles left of it
    (``restrict_rows``); a band call is cut by rows only (its band bounds its keys).

    Why: a kernel call's backward makes its own dq, dK and dV (and the output's stand-in,
    ``rank.kernel_calls.delta_stand_in``) before they are added into the step's sums, so the largest call
    sets the attention backward's transient memory; tiles bound it by ``tile`` rows
    whatever the sequence length, at the price of more, smaller calls. Each tile is exact:
    the backward uses the rows' final (out, lse). ``None``: the calls as they are."""
    if tile is None:
        return calls
    out: list[RowCall] = []
    for call in calls:
        for lo in range(call.q_lo, call.q_hi, tile):
            for piece in restrict_rows(call, lo, min(lo + tile, call.q_hi)):
                if piece.band is not None or piece.causal:
                    out.append(piece)
                    continue
                for k in range(piece.kv_lo, piece.kv_hi, tile):
                    out.append(RowCall(piece.q_lo, piece.q_hi, k, min(k + tile, piece.kv_hi)))
    return tuple(out)
