"""``placement="auto"`` (issue 48): the placement map computed from the CP group's nodes.

* Pure: node numbers from hostnames; ``auto_map`` keeps a team inside its node where the
  CP ranks alternate between two nodes (the team placement puts every team across them)
  and is predicted faster than both named placements; on one node it is the team map.
* Several ranks (8, gloo; the hostnames of two emulated nodes, ranks alternating): the map
  ``auto_placement`` returns runs exactly (float64, out and every gradient) and sends
  fewer bytes off-node, counted by the ledger per link, than the team and ring placements
  in the same run (a test that fails with the map replaced by the team placement); every
  rank gets the same map; the 2-D split's ring groups get one too.
* CP groups whose nodes lie in different patterns, or ranks that disagree on the setting:
  a ``ValueError`` on every rank before any group.
"""

from __future__ import annotations

import socket

import pytest
import torch
from common import TOL, assert_matches_reference, make_inputs, reference, shard
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.planner.cluster import CLUSTER_PRESETS
from startrail_megatron.planner.placement import auto_map, map_cost
from startrail_megatron.planner.shape import AttnShape
from startrail_megatron.schedule.layout import nodes_from_hosts

S_LOCAL, D = 12, 8


def test_nodes_from_hosts_numbers_nodes_in_order_of_first_appearance():
    assert nodes_from_hosts(["b", "a", "b", "c", "a"]) == (0, 1, 0, 2, 1)
    assert nodes_from_hosts([]) == ()


def test_auto_map_keeps_teams_inside_alternating_nodes():
    """CP ranks alternating between two nodes (Megatron's CP group under a tensor-parallel
    size of 2 on nodes it does not fill in order): the team placement sends every team
    collective off-node; the computed map pairs ranks of one node and is predicted faster
    than both named placements."""
    nodes = (0, 1) * 4
    m = auto_map(nodes, 2)
    assert sorted(m) == list(range(8))
    lay = st.StarTrailLayout(8, 2, m)
    for t in range(lay.num_teams):
        assert len({nodes[r] for r in lay.team_ranks(t)}) == 1, (t, m)
    shape = AttnShape(8, 4096, 1, 32, 8, 128, elem_bytes=2, acc_bytes=4, causal=True)
    cl = CLUSTER_PRESETS["h100-ib"].with_(gpus_per_node=4, num_nodes=2, rank_nodes=nodes)
    named = [map_cost(cl, shape, 2, pl) for pl in ("team", "ring")]
    assert map_cost(cl, shape, 2, m) < min(named), named
    slow = CLUSTER_PRESETS["a100-eth"].with_(gpus_per_node=4, num_nodes=2, rank_nodes=nodes)
    m = auto_map(nodes, 2, cluster=slow)
    named = [map_cost(slow, shape, 2, pl) for pl in ("team", "ring")]
    assert map_cost(slow, shape, 2, m) < 0.9 * min(named), named
    assert auto_map((0,) * 8, 2) == tuple(range(8))  # one node: the team placement


def test_cluster_rank_nodes_are_checked():
    base = CLUSTER_PRESETS["h100-ib"].with_(gpus_per_node=2, num_nodes=2)
    with pytest.raises(ValueError, match="rank_nodes=.* puts more than gpus_per_node=2"):
        base.with_(rank_nodes=(0, 0, 0, 1))
    with pytest.raises(ValueError, match=r"rank_nodes=\(0, 2\) must list each CP rank's node"):
        base.with_(rank_nodes=(0, 2))
    assert base.with_(rank_nodes=(1, 0, 1, 0)).node(2) == 1


def _alternating_host(rank: int) -> str:
    return f"emulated-node-{rank % 2}"


def _auto_rank(rank, world, by_hostname):
    """Attention under the auto map and both named placements; out and grads of the auto
    one, and every placement's bytes sent off-node (this rank's, by the ledger)."""
    import torch.distributed as dist

    from startrail_megatron.auto_placement import auto_placement

    real = socket.gethostname
    try:
        if by_hostname:
            socket.gethostname = lambda: _alternating_host(rank)
            m = auto_placement(2)
        else:
            m = auto_placement(2, rank_nodes=[r % 2 for r in range(world)])
    finally:
        socket.gethostname = real
    q, k, v, do = make_inputs(7, S_LOCAL * world, 1, 4, 2, D)
    off, grads = {}, None
    for name, placement in (("auto", m), ("team", "team"), ("ring", "ring")):
        groups = st.StarTrailGroups.create(2, placement=placement)
        local = [shard(x, rank, world, True).requires_grad_() for x in (q, k, v)]
        ledger = st.CommLedger()
        out = st.startrail_attention(*local, groups, causal=True, kernel="torch", ledger=ledger)
        out.backward(shard(do, rank, world, True))
        off[name] = ledger.bytes_by_link(rank, lambda r: r % 2)["inter_node"]
        if name == "auto":
            grads = [out.detach(), *(x.grad for x in local)]
            ran = groups.layout.placement
    dist.barrier()
    return grads, m, ran, off


@pytest.mark.parametrize("by_hostname", [True, False], ids=["hostnames", "rank_nodes"])
def test_auto_map_is_exact_and_moves_fewer_bytes_off_node(by_hostname):
    res = run_ranks(8, _auto_rank, by_hostname)
    q, k, v, do = make_inputs(7, S_LOCAL * 8, 1, 4, 2, D)
    assert_matches_reference(res, reference(q, k, v, do, True)[:4], True, torch.float64,
                             TOL[torch.float64])  # fmt: skip
    maps = {r[1] for r in res}
    assert len(maps) == 1 and maps == {r[2] for r in res}, maps  # one map, and it ran
    total = {name: sum(r[3][name] for r in res) for name in ("auto", "team", "ring")}
    assert total["auto"] < 0.7 * min(total["team"], total["ring"]), total


def _split_rank(rank, world):
    from startrail_megatron.auto_placement import auto_placement

    nodes = [(r // 2) % 2 for r in range(world)]  # ring groups (CP r, r+2, ...) alternate
    m = auto_placement(2, ulysses_size=2, rank_nodes=nodes)
    groups = st.UlyssesStarTrailGroups.create(2, 2, placement=m)
    q, k, v, do = make_inputs(9, S_LOCAL * world, 1, 4, 2, D)
    local = [shard(x, rank, world, True).requires_grad_() for x in (q, k, v)]
    out = st.startrail_attention(*local, groups, causal=True, kernel="torch")
    out.backward(shard(do, rank, world, True))
    lay = groups.layout.ring
    ring0 = groups.layout.ring_ranks(0)
    same_node = all(
        len({nodes[ring0[r]] for r in lay.team_ranks(t)}) == 1 for t in range(lay.num_teams)
    )
    return [out.detach(), *(x.grad for x in local)], m, same_node


def test_auto_map_for_the_split_ring_groups():
    res = run_ranks(8, _split_rank)
    q, k, v, do = make_inputs(9, S_LOCAL * 8, 1, 4, 2, D)
    assert_matches_reference(res, reference(q, k, v, do, True)[:4], True, torch.float64,
                             TOL[torch.float64])  # fmt: skip
    assert len({r[1] for r in res}) == 1 and all(r[2] for r in res), [r[1:] for r in res]


def _refused_rank(rank, world, case):
    import torch.distributed as dist

    from startrail_megatron.auto_placement import auto_placement

    cp = None
    for ranks in ([0, 1, 2, 3], [4, 5, 6, 7]):
        g = dist.new_group(ranks)
        if rank in ranks:
            cp = g
    try:
        if case == "patterns":  # group 0 fills its two nodes in order, group 1 alternates
            auto_placement(2, cp, rank_nodes=[0, 0, 1, 1, 2, 3, 2, 3])
        else:  # rank 5 prices another shape
            shape = AttnShape(4, 64 * (1 + (rank == 5)), 1, 4, 4, 8)
            auto_placement(2, cp, shape=shape, rank_nodes=[0, 0, 1, 1, 2, 3, 2, 3])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "case,match",
    [
        ("patterns", r"placement='auto': the StarTrail groups lie on their nodes in different"),
        ("setting", r"placement='auto': the ranks disagree on \(team_size, ulysses_size, shape"),
    ],
)
def test_auto_map_refusals_on_every_rank(case, match):
    import re

    for msg in run_ranks(8, _refused_rank, case):
        assert msg is not None and re.search(match, msg), msg
