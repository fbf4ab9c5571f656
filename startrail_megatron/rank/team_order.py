"""Team order: where each row of a team's buffers comes from, as index tensors.

A team all-gather gives the members' local rows in member order; the schedule plans
calls on the team buffer's order (``schedule``: ascending zigzag chunks under the causal
mask, per packed document the team's chunks in ascending order). ``TeamOrder`` maps
between the two; ``real_rows`` names a rank's local rows that are real tokens (the rest
of a packed document's rows are padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
from torch import Tensor

from ..schedule import packed_team_order
from ..schedule.layout import StarTrailLayout
from ..schedule.packing import PackedLayout
from ..zigzag import inverse_order, reorder_chunks, reorder_chunks_

__all__ = ["TeamOrder", "index_tensor", "real_rows"]


def index_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host ints on ``device``; to CUDA through pinned memory without a blocking copy
    (built once per packed layout, in the first layer's call)."""
    x = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@lru_cache(maxsize=8)  # one team per rank: the batches in flight (forward, backward)
def _packed_index(
    layout: StarTrailLayout, team: int, packed: PackedLayout, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """(order, its inverse) of ``schedule.packed_team_order`` as index tensors on
    ``device``, built once per packed layout rather than in every layer's call; ``None``
    when the order is the identity (a team of one rank)."""
    order = packed_team_order(layout, team, packed)
    if order == tuple(range(len(order))):
        return None
    idx = index_tensor(list(order), torch.long, device)
    return idx, torch.argsort(idx)


@lru_cache(maxsize=8)  # as _packed_index: built once per layout, not in every layer's call
def real_rows(packed: PackedLayout | None, cp_rank: int, device: torch.device) -> Tensor | None:
    """CP rank ``cp_rank``'s local rows that are real tokens (``PackedLayout.real_rows``)
    as an index tensor on ``device``, or ``None`` when all are (or nothing is packed)."""
    if packed is None:
        return None
    rows = packed.real_rows(cp_rank)
    if len(rows) == packed.s_local:
        return None
    return index_tensor(list(rows), torch.long, device)


@dataclass(frozen=True)
class TeamOrder:
    """Member order (what the team all-gather gives) <-> team-buffer order, on dim 0."""

    layout: StarTrailLayout
    team: int
    member: int
    causal: bool
    packed: PackedLayout | None = None

    @cached_property
    def _chunk_order(self) -> tuple[list[int], list[int]]:
        """Dense: (chunk permutation to team order, its inverse), in units of a local
        half (zigzag chunks causal; any equal halves without the mask)."""
        c2 = 2 * self.layout.team_size
        perm = self.layout.team_chunk_order(self.team) if self.causal else list(range(c2))
        return perm, inverse_order(perm)

    def _index(self, device: torch.device, inverse: bool) -> Tensor | None:
        index = _packed_index(self.layout, self.team, self.packed, device)
        return None if index is None else index[inverse]

    def to_team(self, x: Tensor, in_place: bool = False) -> Tensor:
        """The all-gathered member order -> the team buffer's order (rows, dim 0).
        ``in_place``: ``x`` is dead after the call, so dense rows are moved inside its own
        storage (``reorder_chunks_``: one chunk's copy, not a second ``x``; ``x`` itself
        is returned); packed rows are still gathered into a new tensor."""
        return self._reorder(x, False, in_place)

    def from_team(self, x: Tensor, in_place: bool = False) -> Tensor:
        """The team buffer's order -> member order (the inverse of ``to_team``); ``in_place``
        as there."""
        return self._reorder(x, True, in_place)

    def _reorder(self, x: Tensor, inverse: bool, in_place: bool) -> Tensor:
        if self.packed is None:
            order = self._chunk_order[int(inverse)]
            return reorder_chunks_(x, order) if in_place else reorder_chunks(x, order)
        idx = self._index(x.device, inverse)
        return x if idx is None else x.index_select(0, idx)

    def member_rows(self, x: Tensor, s_local: int) -> Tensor:
        """This member's own ``s_local`` rows (member order) of team-order rows ``x``."""
        return self.from_team(x)[self.member * s_local : (self.member + 1) * s_local]

    def team_positions(self, local_rows: Tensor, n: int) -> Tensor:
        """Where this member's local rows ``local_rows`` sit in the team buffer of ``n``
        rows."""
        s_local = n // self.layout.team_size
        order = self.from_team(torch.arange(n, device=local_rows.device))
        return order[self.member * s_local + local_rows]
