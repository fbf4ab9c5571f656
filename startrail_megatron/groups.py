"""StarTrail's process groups, built from the pure layout over a CP group."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .layout import Placement, StarTrailLayout

__all__ = ["StarTrailGroups"]


@dataclass(frozen=True)
class StarTrailGroups:
    """The groups one CP rank uses, created once and passed explicitly.

    Attributes:
        layout: the pure rank arithmetic (P, C, placement).
        cp_group: the context-parallel group (``None`` = the default world).
        cp_rank: this rank's index in ``cp_group``.
        team_group: the C ranks of this rank's team (``None`` when C = 1).
        subring_group: the G ranks of this rank's sub-ring (``None`` when G = 1).
    """

    layout: StarTrailLayout
    cp_group: dist.ProcessGroup | None
    cp_rank: int
    team_group: dist.ProcessGroup | None
    subring_group: dist.ProcessGroup | None

    @property
    def team_size(self) -> int:
        return self.layout.team_size

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @classmethod
    def create(
        cls,
        team_size: int,
        cp_group: dist.ProcessGroup | None = None,
        placement: Placement = "team",
        *,
        timeout: timedelta | None = None,
    ) -> StarTrailGroups:
        """Build the team and sub-ring groups over ``cp_group`` (a collective call).

        Like Megatron's own group creation, every rank of the default world
        must call this, with the same arguments, at the same point: when
        ``cp_group`` is one of several CP groups (one per data-parallel
        replica, say), the ranks first exchange their CP groups' members
        (one small all-gather) and then every rank creates every group of
        every CP group in the same order. ``timeout`` applies to the new
        groups (default: the process group default). The setting is checked
        before any communication.
        """
        if not dist.is_initialized():
            raise RuntimeError("StarTrailGroups.create needs torch.distributed to be initialized")
        cp_size = dist.get_world_size(cp_group)
        layout = StarTrailLayout(cp_size, team_size, placement)  # ValueError on a bad setting
        cp_rank = dist.get_rank(cp_group)
        if cp_group is None:
            mine = tuple(range(cp_size))
            all_cp = [mine]
        else:
            mine = tuple(dist.get_global_rank(cp_group, r) for r in range(cp_size))
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            if any(len(g) != cp_size for g in gathered):
                raise ValueError(
                    f"every rank's cp_group must have the same size; got sizes "
                    f"{sorted({len(g) for g in gathered})}"
                )
            all_cp = sorted(set(gathered))

        team, member = layout.coord(cp_rank)
        team_group = subring_group = None
        for cp_ranks in all_cp:
            ours = cp_ranks == mine
            if layout.team_size > 1:
                for t in range(layout.num_teams):
                    g = dist.new_group(
                        [cp_ranks[r] for r in layout.team_ranks(t)],
                        timeout=timeout,
                        sort_ranks=False,  # group rank order = member order, as listed
                        group_desc=f"startrail_team_{t}",
                    )
                    if ours and t == team:
                        team_group = g
            if layout.ring_size > 1:
                for gi in range(layout.team_size):
                    for a in range(layout.team_size):
                        g = dist.new_group(
                            [cp_ranks[r] for r in layout.subring_ranks(gi, a)],
                            timeout=timeout,
                            sort_ranks=False,  # group rank order = ring order, as listed
                            group_desc=f"startrail_subring_{gi}_{a}",
                        )
                        if ours and (gi, a) == (layout.team_group(team), member):
                            subring_group = g
        return cls(layout, cp_group, cp_rank, team_group, subring_group)
