"""The forward's team combine: the C members' partial (out, lse) of the team's query rows
merged by the log-sum-exp rule and scattered, each rank keeping its own rows.

``TeamCombine`` owns the running accumulators the forward's kernel calls merge into, and
combines them head group by head group (``schedule.tail_head_groups``) so each group's
collectives overlap the next group's compute (``attention.py``'s Note [overlap]).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..comm import DoneHandle, Handle
from ..schedule import tail_head_groups
from .call import RankCall
from .team_order import TeamOrder

__all__ = ["TeamCombine"]


class TeamCombine:
    """The team's running (out ``[n, b, hq, d]``, lse ``[b, hq, n]``) in the accumulation
    dtype, and their combine.

    ``done(g)`` once group g's heads have all their partial (out, lse): it starts the
    all-gather of their partial lse, then finishes group g-1 (waits its lse, rescales
    its out, starts its reduce-scatter), so group g's lse is in flight while group g+1
    computes and group g-1's out while group g's lse travels. ``result()`` finishes the
    last group and waits the reduce-scatters: (out in member-order rows, lse_team); the
    accumulators are freed once the last group is copied out. C = 1: no collectives;
    ``sinks`` (one logit per query head, joining every row's denominator) and nothing
    else rescale the rows.
    """

    def __init__(
        self, rc: RankCall, order: TeamOrder, like: Tensor, n: int, heads_kv: int,
        acc: torch.dtype, sinks: Tensor | None,
    ):  # fmt: skip
        _, b, hq, d = like.shape
        self.rc, self.order, self.sinks = rc, order, sinks
        self.out = torch.zeros(n, b, hq, d, dtype=acc, device=like.device)
        self.lse = torch.full((b, hq, n), -math.inf, dtype=acc, device=like.device)
        self.groups = tail_head_groups(rc.layout, hq, heads_kv, bool(rc.options.dropout_p))
        self._lse_handles: dict[int, Handle] = {}
        self._out_handles: list[Handle] = []
        self._lse_team = torch.empty_like(self.lse)
        self._finished = -1

    def done(self, g: int) -> None:
        if self.rc.layout.team_size > 1:
            qh = self.groups[g][0]
            part = self.lse[:, qh].unsqueeze(0)  # [1, b, hg, n]
            self._lse_handles[g] = self.rc.team_comm.all_gather_start(part, "lse")
        if g > 0:
            self._finish(g - 1)

    def _finish(self, g: int) -> None:
        C = self.rc.layout.team_size
        qh = self.groups[g][0]
        part_lse = self.lse[:, qh]
        if C > 1:
            lse = torch.logsumexp(self._lse_handles.pop(g).wait(), dim=0)  # [b, hg, n]
        else:
            lse = part_lse
        if self.sinks is not None:  # the sink's exp(logit) joins every row's denominator
            sk = self.sinks.to(lse.dtype)[qh]
            lse = torch.logaddexp(lse, sk.view(1, -1, 1))
        out = self.out[:, :, qh]
        if C > 1 or self.sinks is not None:
            safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
            out.mul_(torch.exp(part_lse - safe).permute(2, 0, 1).unsqueeze(-1))
        self._lse_team[:, qh] = lse
        # In place: these rows of the accumulators are dead once scattered, so a group of
        # every head reduce-scatters from the accumulator itself (no second team out).
        member_order = self.order.from_team(out, in_place=True)
        del out, part_lse, lse
        if g == len(self.groups) - 1:  # every group copied out: the accumulators are dead
            self.out = self.lse = None
        if C > 1:
            self._out_handles.append(self.rc.team_comm.reduce_scatter_start(member_order, "out"))
        else:
            self._out_handles.append(DoneHandle(member_order))
        self._finished = g

    def result(self) -> tuple[Tensor, Tensor]:
        for g in range(self._finished + 1, len(self.groups)):  # done() ran for every group
            self._finish(g)
        parts = [h.wait() for h in self._out_handles]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return out, self._lse_team
