"""``placement="auto"``: StarTrail's placement map computed from the CP group's nodes.

The adapters (Megatron's ``--startrail-placement auto``, DeepSpeed's ``"placement":
"auto"``) call ``auto_placement`` before creating the groups and pass the map it returns
as the placement (``StarTrailGroups.create`` checks that every rank passes the same one).
It finds each CP rank's node from the ranks' hostnames (one small all-gather over the
world; or from ``rank_nodes`` given explicitly) and runs the planner's map search on them
(``planner.placement.auto_map``). Every rank computes the same map from the same gathered
facts; where the CP groups (one per data-parallel replica, say) or the 2-D split's ring
groups lie on their nodes in different patterns, their best maps may differ, and one
placement cannot serve them all: that is a ``ValueError`` naming the groups, before any
group is created.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import torch.distributed as dist

from .planner.cluster import ClusterSpec
from .planner.placement import auto_map
from .planner.shape import AttnShape
from .schedule.layout import StarTrailLayout, nodes_from_hosts
from .schedule.ulysses import UlyssesLayout

__all__ = ["auto_placement", "resolve_placement"]


def auto_placement(
    team_size: int,
    cp_group: dist.ProcessGroup | None = None,
    *,
    ulysses_size: int = 1,
    shape: AttnShape | None = None,
    cluster: ClusterSpec | None = None,
    rank_nodes: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The placement map for StarTrail with team size ``team_size`` over ``cp_group`` (over
    its ring groups of P / ``ulysses_size`` ranks for the 2-D split): a collective over the
    default world (every rank calls it at the same point with the same arguments, as
    ``StarTrailGroups.create``).

    ``shape``: the attention call it prices (its ``cp_size`` the StarTrail ranks; default
    ``planner.placement.AUTO_SHAPE``); ``cluster``: the link and kernel rates (default the
    ``AUTO_CLUSTER`` preset; its nodes are replaced by the ranks' own); ``rank_nodes``: each
    global rank's node, where hostnames do not tell them apart (default: by hostname).
    A bad setting is a ``ValueError`` before any communication."""
    if not dist.is_initialized():
        raise RuntimeError("auto_placement needs torch.distributed to be initialized")
    cp_size = dist.get_world_size(cp_group)
    if ulysses_size > 1:
        rings = [UlyssesLayout(cp_size, ulysses_size, team_size, "team").ring_ranks(u)
                 for u in range(ulysses_size)]  # fmt: skip
    else:
        StarTrailLayout(cp_size, team_size, "team")  # ValueError on a bad team size
        rings = [list(range(cp_size))]
    ranks = len(rings[0])
    if shape is not None and shape.cp_size != ranks:
        raise ValueError(
            f"placement='auto': shape.cp_size={shape.cp_size} must be the StarTrail ranks, "
            f"{ranks} (CP size {cp_size} / ulysses_size {ulysses_size})"
        )
    world = dist.get_world_size()
    if rank_nodes is not None and len(rank_nodes) != world:
        raise ValueError(
            f"placement='auto': rank_nodes has {len(rank_nodes)} entries; it needs one node "
            f"per global rank ({world})"
        )
    if cp_group is None:
        mine = tuple(range(cp_size))
    else:
        mine = tuple(dist.get_global_rank(cp_group, r) for r in range(cp_size))
    me = dist.get_rank()
    host = socket.gethostname() if rank_nodes is None else f"node {rank_nodes[me]}"
    setting = (team_size, ulysses_size, repr(shape), repr(cluster))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (mine, host, setting))
    if len({g[2] for g in gathered}) > 1:
        raise ValueError(
            "placement='auto': the ranks disagree on (team_size, ulysses_size, shape, "
            "cluster); every rank must pass the same"
        )
    maps: dict[tuple[int, ...], tuple[tuple[int, ...], list]] = {}
    for cp_ranks in sorted({g[0] for g in gathered}):
        for ring in rings:
            nodes = nodes_from_hosts([gathered[cp_ranks[r]][1] for r in ring])
            if nodes not in maps:
                maps[nodes] = (auto_map(nodes, team_size, shape, cluster), [])
            maps[nodes][1].append([cp_ranks[r] for r in ring])
    found = {m for m, _ in maps.values()}
    if len(found) > 1:
        where = "; ".join(
            f"ranks {groups[0]} (nodes {list(nodes)}): map {list(m)}"
            for nodes, (m, groups) in maps.items()
        )
        raise ValueError(
            "placement='auto': the StarTrail groups lie on their nodes in different patterns "
            f"and their best maps differ ({where}); pass placement 'team', 'ring' or one map"
        )
    return found.pop()


def resolve_placement(
    placement,
    team_size: int,
    cp_group: dist.ProcessGroup | None = None,
    *,
    ulysses_size: int = 1,
    shape: AttnShape | None = None,
):
    """The placement the groups take for an adapter's setting: ``"auto"`` becomes
    ``auto_placement``'s map (a collective over the default world), anything else is
    returned as it is."""
    if placement != "auto":
        return placement
    return auto_placement(team_size, cp_group, ulysses_size=ulysses_size, shape=shape)
