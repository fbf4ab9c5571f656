"""StarTrail's groups for Megatron's context-parallel groups: the registry.

Megatron keeps its process groups in ``parallel_state``; StarTrail's team and
sub-ring groups are built from Megatron's CP group and kept here, keyed by
that CP group, so an attention module finds the groups for the CP group its
``pg_collection`` names. ``create_startrail_groups(cp_group, team_size,
placement)`` registers them: called by the ``install`` hooks (``hooks.py``)
right after ``initialize_model_parallel``, or explicitly by runs that build
their own process-group collection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..comm import CommLedger
from ..groups import StarTrailGroups
from ..layout import Placement

__all__ = [
    "StarTrailMegatronState",
    "clear_startrail_groups",
    "create_startrail_groups",
    "get_startrail_state",
    "release_startrail_groups",
]


@dataclass
class StarTrailMegatronState:
    """What the attention modules of one CP group share."""

    groups: StarTrailGroups
    kernel: str = "auto"
    ledger: CommLedger = field(default_factory=CommLedger)


_STATES: dict[int, tuple[object, StarTrailMegatronState]] = {}


def _key(cp_group) -> int:
    return id(cp_group if cp_group is not None else dist.GroupMember.WORLD)


def create_startrail_groups(
    cp_group,
    team_size: int,
    placement: Placement = "team",
    kernel: str = "auto",
    timeout: timedelta | None = None,
) -> StarTrailMegatronState:
    """Build and register StarTrail's groups for ``cp_group`` (collective over it).

    ``timeout``: of the new groups (default: the default process group's)."""
    groups = StarTrailGroups.create(
        team_size, cp_group=cp_group, placement=placement, timeout=timeout
    )
    state = StarTrailMegatronState(groups, kernel)
    _STATES[_key(cp_group)] = (cp_group, state)
    return state


def get_startrail_state(cp_group) -> StarTrailMegatronState:
    entry = _STATES.get(_key(cp_group))
    if entry is None:
        raise RuntimeError(
            "StarTrail attention found no StarTrail groups for its context-parallel group: "
            "run with --context-parallel-impl startrail (or call "
            "startrail_megatron.megatron.install(team_size=...) before "
            "parallel_state.initialize_model_parallel, or "
            "startrail_megatron.megatron.create_startrail_groups(cp_group, team_size))"
        )
    return entry[1]


def clear_startrail_groups() -> None:
    _STATES.clear()


def release_startrail_groups(cp_group) -> None:
    """Forget the StarTrail groups registered for ``cp_group`` and destroy their team and
    sub-ring groups (their communicators); collective over ``cp_group``. Nothing when
    none are registered."""
    entry = _STATES.pop(_key(cp_group), None)
    if entry is None:
        return
    groups = entry[1].groups
    for g in (groups.team_group, groups.subring_group):
        if g is not None:
            dist.destroy_process_group(g)
