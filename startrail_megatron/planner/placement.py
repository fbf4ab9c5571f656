"""A placement for any node size: the map of StarTrail's logical ranks onto CP ranks that the
cost model predicts fastest on a cluster's nodes.

The paper's two placements are two maps: ``team`` keeps each team on adjacent CP ranks,
``ring`` each sub-ring. Where the sub-ring length G = P/C^2 does not fit the node size
(P = 24, C = 2 on nodes of 8: G = 6), both send across nodes at every step. Any
permutation of the CP ranks is exact (``schedule.layout``: a map), so the planner can pick
one: ``node_map`` starts from the better named placement and moves ranks between nodes
(swapping two CP ranks of different nodes in the map) while the predicted step time
(``times.startrail_times``: the slowest rank of every P2P step, the node links shared by
the ranks that send off-node at once, the team collectives over their slowest edge) goes
down. Swapping two ranks of one node changes no cost, so only swaps across nodes are
tried. Pure: no torch.
"""

from __future__ import annotations

from .cluster import ClusterSpec
from .shape import AttnShape

__all__ = ["map_cost", "node_map"]


def map_cost(cluster: ClusterSpec, shape: AttnShape, team_size: int, placement) -> float:
    """Predicted seconds of one attention forward and backward under ``placement`` (a named
    placement or a map) with team size ``team_size``."""
    from .strategies import Strategy

    st = Strategy("startrail", team_size, placement)
    fwd, bwd = st.spec.times(st, cluster, shape)
    return fwd + bwd


def node_map(
    cluster: ClusterSpec, shape: AttnShape, team_size: int, *, max_evals: int = 4000
) -> tuple[tuple[int, ...], float]:
    """(map, predicted seconds): the placement map for ``team_size`` on ``cluster``'s nodes
    that the cost model predicts fastest among those a first-improvement local search
    reaches from the better of ``team`` and ``ring`` (at most ``max_evals`` evaluations).
    Never predicted slower than either named placement; on one node it is ``team``'s."""
    from ..schedule.layout import PLACEMENTS, StarTrailLayout

    p = shape.cp_size
    start, best = None, float("inf")
    for name in PLACEMENTS:
        lay = StarTrailLayout(p, team_size, name)
        m = tuple(lay.rank(t, a) for t in range(lay.num_teams) for a in range(team_size))
        cost = map_cost(cluster, shape, team_size, m)
        if cost < best:
            start, best = m, cost
    current = list(start)
    if len({cluster.node(r) for r in range(p)}) == 1:
        return tuple(current), best
    evals, improved = 0, True
    while improved and evals < max_evals:
        improved = False
        for i in range(p):
            for j in range(i + 1, p):
                if cluster.node(current[i]) == cluster.node(current[j]):
                    continue
                current[i], current[j] = current[j], current[i]
                cost = map_cost(cluster, shape, team_size, tuple(current))
                evals += 1
                if cost < best * (1 - 1e-9):
                    best, improved = cost, True
                else:
                    current[i], current[j] = current[j], current[i]
                if evals >= max_evals:
                    break
            if evals >= max_evals:
                break
    return tuple(current), best
