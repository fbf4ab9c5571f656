"""StarTrail's groups for Megatron's context-parallel groups: the registry.

Megatron keeps its process groups in ``parallel_state``; StarTrail's team and
sub-ring groups are built from a CP group and registered here under that CP
group, so an attention module finds the groups for the CP group its
``pg_collection`` names (looked up per call). ``create_startrail_groups(cp_group,
team_size, placement)`` registers them: called by the ``install`` hooks
(``hooks.py``) right after ``initialize_model_parallel``, or explicitly by runs
that build their own process-group collection.

The key is the CP group object itself (``None``: the default world group).
A ``ProcessGroup`` hashes by identity and the entry holds it, so no other
group can take its key while it is registered (an ``id()`` key could be
reused once a group is gone). A weak key would not help: the entry's
``StarTrailGroups`` refers to the CP group, so it would never expire.

Entries end only when released, which is complete: ``release_startrail_groups``
drops the entry and destroys the team and sub-ring groups it created (their
communicators); ``release_all_startrail_groups`` does it for every entry (the
``install`` hook runs it in ``destroy_model_parallel``). Release before
destroying the default process group (after that torch has already shut
every group down, and release only drops the entries).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..auto_placement import resolve_placement
from ..comm import CommLedger
from ..groups import StarTrailGroups, UlyssesStarTrailGroups
from ..planner.shape import AttnShape
from ..schedule import check_head_chunks_setting, check_tile
from ..schedule.layout import Placement

__all__ = [
    "StarTrailMegatronState",
    "create_startrail_groups",
    "get_startrail_state",
    "registered_cp_groups",
    "release_all_startrail_groups",
    "release_startrail_groups",
]


@dataclass
class StarTrailMegatronState:
    """What the attention modules of one CP group share."""

    groups: StarTrailGroups | UlyssesStarTrailGroups
    kernel: str = "auto"
    ledger: CommLedger = field(default_factory=CommLedger)
    """Every transfer the attention of this CP group made on this rank."""
    local_lengths: set = field(default_factory=set)
    """The local sequence lengths the attention saw on this rank (S/P when sharding works)."""
    calls_by_length: Counter = field(default_factory=Counter)
    """Attention calls per local length since the ledger was last read (the entry point
    compares the ledger with ring attention's bytes at the same shapes)."""
    dropout_calls: int = 0
    """Attention calls that ran attention dropout on this rank."""
    attention_tile: int | None = None
    """``startrail_attention(tile=)`` of every call (``--startrail-attention-tile``)."""
    attention_head_chunks: int | None = None
    """``startrail_attention(head_chunks=)`` of every call
    (``--startrail-attention-head-chunks``)."""


_REGISTRY: dict[dist.ProcessGroup | None, StarTrailMegatronState] = {}


def _key(cp_group) -> dist.ProcessGroup | None:
    """The registry key of ``cp_group``: the group; ``None`` is the default world group."""
    return cp_group if cp_group is not None else dist.group.WORLD


def create_startrail_groups(
    cp_group,
    team_size: int,
    placement: Placement = "team",
    kernel: str = "auto",
    timeout: timedelta | None = None,
    own_rows_first: bool | None = None,
    ulysses_size: int = 1,
    attention_tile: int | None = None,
    attention_head_chunks: int | None = None,
    placement_shape: AttnShape | None = None,
) -> StarTrailMegatronState:
    """Build and register StarTrail's groups for ``cp_group`` (collective over it; with
    ``placement="auto"`` over the default world).

    An entry already registered for ``cp_group`` is released first (its groups
    destroyed). ``timeout``: of the new groups (default: the default process group's).
    ``own_rows_first``: ``StarTrailGroups.own_rows_first``. ``ulysses_size`` > 1: the 2-D
    split's groups (``UlyssesStarTrailGroups``; ``--startrail-ulysses-size``).
    ``attention_tile``: the attention's largest kernel call in tokens
    (``--startrail-attention-tile``; ``startrail_attention(tile=)``), checked first;
    ``attention_head_chunks``: ``startrail_attention(head_chunks=)``
    (``--startrail-attention-head-chunks``; checked against the heads at each call).
    ``placement="auto"`` (``--startrail-placement auto``): the map ``auto_placement``
    computes from the CP ranks' hostnames for ``placement_shape`` (the model's attention
    call; default ``planner.placement.AUTO_SHAPE``); the groups' layout holds the map that
    runs, and global rank 0 prints it."""
    check_tile(attention_tile, "--startrail-attention-tile")
    check_head_chunks_setting(attention_head_chunks)
    release_startrail_groups(cp_group)
    ran = resolve_placement(
        placement, team_size, cp_group, ulysses_size=ulysses_size, shape=placement_shape
    )
    if placement == "auto" and dist.get_rank() == 0:
        print(f"StarTrail placement auto: map {list(ran)} (logical rank team*C + member -> "
              "CP rank)", flush=True)  # fmt: skip
    kw = dict(cp_group=cp_group, placement=ran, timeout=timeout)
    if ulysses_size > 1:
        groups = UlyssesStarTrailGroups.create(
            ulysses_size, team_size, own_rows_first=own_rows_first, **kw
        )
    else:
        groups = StarTrailGroups.create(team_size, own_rows_first=own_rows_first, **kw)
    state = StarTrailMegatronState(
        groups, kernel, attention_tile=attention_tile, attention_head_chunks=attention_head_chunks
    )
    _REGISTRY[_key(cp_group)] = state
    return state


def get_startrail_state(cp_group) -> StarTrailMegatronState:
    state = _REGISTRY.get(_key(cp_group))
    if state is None:
        raise RuntimeError(
            "StarTrail attention found no StarTrail groups for its context-parallel group: "
            "run with --context-parallel-impl startrail (or call "
            "startrail_megatron.megatron.install(team_size=...) before "
            "parallel_state.initialize_model_parallel, or "
            "startrail_megatron.megatron.create_startrail_groups(cp_group, team_size))"
        )
    return state


def registered_cp_groups() -> list:
    """The CP groups that have StarTrail groups registered (the world group as itself)."""
    return list(_REGISTRY)


def release_startrail_groups(cp_group) -> None:
    """Forget the StarTrail groups registered for ``cp_group`` and destroy their team and
    sub-ring groups (their communicators); collective over ``cp_group``. Nothing when
    none are registered."""
    state = _REGISTRY.pop(_key(cp_group), None)
    if state is not None:
        _destroy_groups(state.groups)


def release_all_startrail_groups() -> None:
    """``release_startrail_groups`` for every registered CP group (collective over the
    world: every rank releases its own entries, in registration order)."""
    while _REGISTRY:
        release_startrail_groups(next(iter(_REGISTRY)))


def _destroy_groups(groups: StarTrailGroups | UlyssesStarTrailGroups) -> None:
    made = []
    if isinstance(groups, UlyssesStarTrailGroups):  # its ring group and Ulysses group too
        made = [groups.ulysses_group, groups.startrail.cp_group]
        groups = groups.startrail
    for g in (groups.team_group, groups.subring_group, *made):
        if g is None:
            continue
        try:
            dist.destroy_process_group(g)
        except ValueError:  # torch no longer knows it: the default group was destroyed first
            pass
