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

Megatron's hybrid (per-batch) context parallelism (``--hybrid-context-parallel``) runs
each sub-sample on a sub-group of the DP x CP ranks, named per call by
``PackedSeqParams.cp_group`` / ``local_cp_size``. ``create_hybrid_startrail_groups``
registers StarTrail's groups for every such sub-group Megatron made (its
``get_hybrid_data_context_parallel_groups``: every power of two from 2 to half the DP x
CP ranks, and all of them) and for one rank alone (``local_cp_size`` 1, where Megatron
passes no group), each with the largest team size up to the run's that fits it
(``team_size_within``), or with a team size per sub-group size given (the cost model's
pick under ``--startrail-team-size auto``); ``subgroup_state`` finds them per call.

Entries end only when released, which is complete: ``release_startrail_groups``
drops the entry and destroys the team and sub-ring groups it created (their
communicators); ``release_all_startrail_groups`` does it for every entry (the
``install`` hook runs it in ``destroy_model_parallel``). Release before
destroying the default process group (after that torch has already shut
every group down, and release only drops the entries).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..auto_placement import resolve_placement
from ..comm import CommLedger
from ..groups import StarTrailGroups, UlyssesStarTrailGroups
from ..planner.shape import AttnShape
from ..schedule import check_head_chunks_setting, check_tile
from ..schedule.layout import Placement, team_size_within, valid_team_sizes

__all__ = [
    "StarTrailMegatronState",
    "check_hybrid_team_sizes",
    "create_hybrid_startrail_groups",
    "create_startrail_groups",
    "get_startrail_state",
    "hybrid_group_sizes",
    "hybrid_states",
    "hybrid_team_sizes",
    "registered_cp_groups",
    "release_all_startrail_groups",
    "release_startrail_groups",
    "subgroup_group",
    "subgroup_state",
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
_HYBRID: dict[int, dist.ProcessGroup] = {}
"""This rank's hybrid-CP sub-groups by size (1: the one-rank group made for it), each
registered in ``_REGISTRY``."""


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


def hybrid_group_sizes(dp_cp_size: int) -> list[int]:
    """The sub-group sizes megatron-core's hybrid context parallelism makes groups for over
    ``dp_cp_size`` ranks (``parallel_state.create_hybrid_dp_cp_groups``: every power of two
    from 2 below the whole; the whole is the DP x CP group), 1 (no group) excluded."""
    sizes, k = [], 2
    while k < dp_cp_size:
        sizes.append(k)
        k *= 2
    return [*sizes, dp_cp_size] if dp_cp_size > 1 else []


def check_hybrid_team_sizes(team_sizes: Mapping[int, int], sizes: Sequence[int]) -> None:
    """``ValueError`` unless ``team_sizes`` gives each sub-group size of ``sizes`` a team
    size that fits it (its square divides the size). Pure."""
    missing = [k for k in sizes if k not in team_sizes]
    bad = {
        k: c for k, c in team_sizes.items()
        if not isinstance(c, int) or isinstance(c, bool) or c not in valid_team_sizes(k)
    }  # fmt: skip
    if missing or bad:
        raise ValueError(
            f"hybrid team sizes {dict(team_sizes)}: each of the sub-group sizes {list(sizes)} "
            f"needs a team size whose square divides it (missing {missing}, not fitting {bad})"
        )


def create_hybrid_startrail_groups(
    team_size: int,
    placement: Placement = "team",
    kernel: str = "auto",
    timeout: timedelta | None = None,
    team_sizes: Mapping[int, int] | None = None,
    **options,
) -> dict[int, int]:
    """Register StarTrail's groups for every sub-group of Megatron's hybrid context
    parallelism (module docstring) and for one rank alone; a collective over the default
    world, after ``initialize_model_parallel(hybrid_context_parallel=True)``. Each group of
    k ranks gets ``team_sizes[k]`` where given (every size's then: the cost model's pick,
    ``--startrail-team-size auto``), else ``team_size_within(k, team_size)``; ``options``:
    the rest of ``create_startrail_groups``' (not ``ulysses_size`` or ``placement="auto"``,
    which ``ValueError`` refuses). Returns ``{k: team size}``."""
    from megatron.core import parallel_state

    if options.get("ulysses_size", 1) != 1 or placement == "auto":
        raise ValueError(
            "hybrid context parallelism (--hybrid-context-parallel) runs StarTrail with a named "
            "placement ('team' or 'ring') and without the 2-D split (--startrail-ulysses-size 1)"
        )
    n = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    sizes = hybrid_group_sizes(n)
    if team_sizes is not None:
        check_hybrid_team_sizes(team_sizes, sizes)
    for k in sizes:
        group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=k)
        c = team_sizes[k] if team_sizes is not None else team_size_within(k, team_size)
        create_startrail_groups(group, c, placement, kernel, timeout, **options)
        _HYBRID[k] = group
    alone = None
    for r in range(dist.get_world_size()):  # every rank makes every one-rank group, in order
        g = dist.new_group([r], timeout=timeout, group_desc="startrail_alone")
        if r == dist.get_rank():
            alone = g
    if 1 in _HYBRID:  # a second call: the earlier one-rank group's entry goes
        release_startrail_groups(_HYBRID[1])
    create_startrail_groups(alone, 1, "team", kernel, timeout, **options)
    _HYBRID[1] = alone
    return hybrid_team_sizes()


def hybrid_states() -> dict[int, StarTrailMegatronState]:
    """``{k: state}`` of the hybrid-CP sub-groups registered on this rank (empty without
    ``create_hybrid_startrail_groups``)."""
    return {k: _REGISTRY[g] for k, g in sorted(_HYBRID.items()) if g in _REGISTRY}


def hybrid_team_sizes() -> dict[int, int]:
    """``{k: team size}`` of the hybrid-CP sub-groups registered on this rank."""
    return {k: state.groups.team_size for k, state in hybrid_states().items()}


def subgroup_group(size: int):
    """This rank's hybrid-CP sub-group of ``size`` ranks (for ``PackedSeqParams.cp_group``;
    a one-rank group for 1); ``ValueError`` naming the sizes registered."""
    state = hybrid_states().get(size)
    if state is None:
        raise ValueError(
            f"no hybrid-CP sub-group of {size} ranks is registered; sizes: "
            f"{sorted(hybrid_team_sizes())}"
        )
    return state.groups.cp_group


def subgroup_state(cp_group, local_cp_size: int) -> StarTrailMegatronState:
    """The StarTrail groups of a hybrid-CP sub-sample: those registered for ``cp_group``
    (``PackedSeqParams.cp_group``) of ``local_cp_size`` ranks, or of one rank alone where
    ``local_cp_size`` is 1 (Megatron passes no group then). ``ValueError`` where the two
    disagree; ``RuntimeError`` naming the remedy where none are registered."""
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size != local_cp_size:
        raise ValueError(
            f"packed_seq_params.local_cp_size {local_cp_size} but its cp_group has {size} ranks"
        )
    state = _REGISTRY.get(_HYBRID.get(1) if size == 1 else cp_group)
    if state is None:
        raise RuntimeError(
            f"StarTrail attention found no StarTrail groups for the {size}-rank sub-group of "
            "packed_seq_params.cp_group (hybrid context parallelism): they are made when "
            "parallel_state.initialize_model_parallel(hybrid_context_parallel=True) runs under "
            "startrail_megatron.megatron.install(...), or by "
            "startrail_megatron.megatron.registry.create_hybrid_startrail_groups"
        )
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
    _HYBRID.clear()


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
