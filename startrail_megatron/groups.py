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

        Every rank of ``cp_group`` must call this with the same arguments.
        Only the members of each new group take part in its creation
        (``use_local_synchronization``), so different CP groups (e.g. one per
        data-parallel replica) can create theirs independently. The setting is
        checked before any communication.
        """
        if not dist.is_initialized():
            raise RuntimeError("StarTrailGroups.create needs torch.distributed to be initialized")
        cp_size = dist.get_world_size(cp_group)
        layout = StarTrailLayout(cp_size, team_size, placement)  # ValueError on a bad setting
        cp_rank = dist.get_rank(cp_group)

        def to_global(ranks: list[int]) -> list[int]:
            if cp_group is None:
                return ranks
            return [dist.get_global_rank(cp_group, r) for r in ranks]

        team, member = layout.coord(cp_rank)
        team_group = subring_group = None
        if layout.team_size > 1:
            team_group = dist.new_group(
                to_global(layout.team_ranks(team)),
                timeout=timeout,
                use_local_synchronization=True,
                sort_ranks=False,  # group rank order = member / ring order, as listed
                group_desc=f"startrail_team_{team}",
            )
        if layout.ring_size > 1:
            g = layout.team_group(team)
            subring_group = dist.new_group(
                to_global(layout.subring_ranks(g, member)),
                timeout=timeout,
                use_local_synchronization=True,
                sort_ranks=False,  # group rank order = member / ring order, as listed
                group_desc=f"startrail_subring_{g}_{member}",
            )
        return cls(layout, cp_group, cp_rank, team_group, subring_group)
