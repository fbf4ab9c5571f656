"""A placement for any node size: the map of StarTrail's logical ranks onto CP ranks that the
cost model predicts fastest on a cluster's nodes.

The paper's two placements are two maps: ``team`` keeps each team on adjacent CP ranks,
``ring`` each sub-ring. Where the sub-ring length G = P/C^2 does not fit the node size
(P = 24, C = 2 on nodes of 8: G = 6), both send across nodes at every step; where a CP
group's ranks are spread over its nodes out of order (Megatron's CP groups under tensor
parallelism, a scheduler's rank order), both can send off-node where no map has to. Any
permutation of the CP ranks is exact (``schedule.layout``: a map), so the planner picks
one: ``node_map`` starts from each named placement laid over the CP ranks in node order
(and shifted by whole teams, so that the node boundaries fall elsewhere in it), from the
packings of whole sub-rings into nodes (``_subring_starts``) and from every sharing of
whole teams among the nodes where there are few (``_team_starts``), keeps the best, then
moves ranks between nodes while the predicted step time (``times.startrail_times``: the
slowest rank of every P2P step, the node links shared by the ranks that send off-node at
once, the placement's fan-out, the team collectives over their slowest edge, each rank's
causal work) goes down: swapping two CP ranks of different nodes, or two whole teams;
then, with half the evaluations, two CP ranks of one node, which changes no link, only
which chunks of the sequence a team holds and so the causal work of its steps (a
second-order term: 7 % of the predicted time on the emulated 3 x 8 run's model, 0 - 3 %
elsewhere). A local search, bounded in evaluations: never predicted slower than
either named placement, not proven optimal (``exhaustive_map`` checks it where the
assignments of ranks to nodes are few).

``auto_map`` is what ``placement="auto"`` runs on the CP ranks' nodes
(``auto_placement.auto_placement`` finds them from the ranks' hostnames,
``schedule.layout.nodes_from_hosts``). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb, factorial

from .cluster import CLUSTER_PRESETS, ClusterSpec
from .shape import AttnShape

__all__ = [
    "AUTO_CLUSTER",
    "AUTO_SHAPE",
    "auto_map",
    "exhaustive_map",
    "format_map",
    "map_cost",
    "map_strategies",
    "node_assignments",
    "node_map",
    "search_pays",
]

AUTO_CLUSTER = "h100-ib"
"""The preset whose link and kernel rates ``auto_map`` uses where it is given no cluster
(the nodes are the CP group's own)."""

AUTO_SHAPE = dict(s_local=4096, batch=1, heads_q=32, heads_kv=8, head_dim=128)
"""The attention call ``auto_map`` prices where it is given no shape: 4096 tokens per
rank, 32 query and 8 K,V heads of 128, bf16, causal."""


def map_cost(cluster: ClusterSpec, shape: AttnShape, team_size: int, placement) -> float:
    """Predicted seconds of one attention forward and backward under ``placement`` (a named
    placement or a map) with team size ``team_size``."""
    from .strategies import Strategy

    st = Strategy("startrail", team_size, placement)
    fwd, bwd = st.spec.times(st, cluster, shape)
    return fwd + bwd


MAX_SHIFTS = 8
"""At most this many shifts of each named placement start the search (evenly spaced)."""


def _named_maps(p: int, team_size: int) -> list[tuple[int, ...]]:
    """Each named placement (``PLACEMENTS`` order) as a map: logical rank team*C + member
    -> CP rank."""
    from ..schedule.layout import PLACEMENTS, StarTrailLayout

    out = []
    for name in PLACEMENTS:
        lay = StarTrailLayout(p, team_size, name)
        out.append(tuple(lay.rank(t, a) for t in range(lay.num_teams) for a in range(team_size)))
    return out


def _starts(cluster: ClusterSpec, p: int, team_size: int) -> list[tuple[int, ...]]:
    """The search's starting maps: each named placement's logical order laid over the CP
    ranks sorted by node, and shifted by whole teams (at most ``MAX_SHIFTS`` shifts, evenly
    spaced; distinct maps only)."""
    by_node = sorted(range(p), key=lambda r: (cluster.node(r), r))
    out: list[tuple[int, ...]] = []
    for pos in _named_maps(p, team_size):  # each logical rank's place in that CP order
        shifts = list(range(0, p, team_size))
        for shift in shifts[:: max(1, len(shifts) // MAX_SHIFTS)]:
            m = tuple(by_node[(x + shift) % p] for x in pos)
            if m not in out:
                out.append(m)
    return out


MAX_TEAM_ASSIGNMENTS = 256
"""``_team_starts`` tries every assignment of whole teams to nodes where there are at most
this many (3 x 4 ranks, C = 2: 15; 4 x 4: 105; 3 x 8: 5,775, not tried)."""


TEAM_START_GAIN = 0.01
"""A whole-team sharing replaces the named placements' starts only where predicted this
much faster: a sharing can put every sub-ring hop on a node link for a gain smaller
than the model's error (2 nodes x 4 alternating ranks, C = 2: 0.4 % predicted, 1.4x the
off-node bytes of the start it would replace)."""


def node_assignments(items: int, nodes: int, per_node: int):
    """Every partition of ``items`` (teams, or logical ranks) into ``nodes`` unlabelled
    sets of ``per_node`` (the nodes are alike to the model): tuples of node indices, one
    per item, each node first used in order. ``items! / (per_node!^nodes nodes!)`` of them."""
    out = [0] * items

    def place(item: int, fill: list[int]):
        if item == items:
            yield tuple(out)
            return
        empty = fill.index(0) if 0 in fill else -1
        for n in range(nodes):  # a node with room; of the empty ones, only the first
            if fill[n] < per_node and (fill[n] > 0 or n == empty):
                out[item] = n
                fill[n] += 1
                yield from place(item + 1, fill)
                fill[n] -= 1

    yield from place(0, [0] * nodes)


def _ways(items: int, nodes: int, per_node: int) -> int:
    """How many ``node_assignments`` there are, without building them."""
    ways = 1
    for i in range(nodes):
        ways *= comb(items - i * per_node, per_node)
    return ways // factorial(nodes)


def _team_starts(cluster: ClusterSpec, p: int, team_size: int) -> list[tuple[int, ...]]:
    """Maps that keep every team on one node, one for each way of sharing the teams among
    the nodes, where each node holds the same number of CP ranks, a multiple of the team
    size, and there are at most ``MAX_TEAM_ASSIGNMENTS`` ways (else none). The swaps of
    ``node_map`` move one rank or two teams at a time, so they can stop at a map a better
    sharing of whole teams beats (3 x 4 ranks, C = 2, on ``h100-ib``: 3 % faster)."""
    order = _ranks_by_node(cluster, p)
    if order is None or len(order) < 2 or len(order[0]) % team_size:
        return []
    n = len(order)
    teams, slots = p // team_size, len(order[0]) // team_size
    if _ways(teams, n, slots) > MAX_TEAM_ASSIGNMENTS:
        return []
    return [_laid(a, order, team_size) for a in node_assignments(teams, n, slots)]


MAX_SUBRING_ORDERS = 120
"""``_subring_starts`` tries every order of the C^2 sub-rings where there are at most this
many (C = 2: 24), else each cyclic shift of the sub-rings and of their reverse."""


def _subring_starts(cluster: ClusterSpec, p: int, team_size: int) -> list[tuple[int, ...]]:
    """Maps that keep as many whole sub-rings on one node as fit: each node in turn takes
    the next sub-rings (in some order) while a whole one fits its free ranks, and the
    sub-rings left over are laid in ring order over the ranks still free, node after node
    (3 x 8 ranks, C = 2, G = 6: three sub-rings whole, the fourth in pieces of 2 on every
    node, so each node link carries one sub-ring hop per step where the ``ring``
    placement's two split sub-rings put two on the middle node's). No swap of one rank or
    two teams moves a whole sub-ring, so ``node_map``'s search alone does not reach these
    (its best at the 3 x 8 campaign's model: 1.78 of ring's time; this start's: 1.43).
    One map per order of the sub-rings (``MAX_SUBRING_ORDERS``) and order of the nodes
    (all of up to 3 nodes, else each cyclic shift): which CP ranks, and so which chunks of
    the sequence, form each team changes the causal work of the model's every step; none
    where the nodes hold unequal numbers of CP ranks or no whole sub-ring fits a node."""
    from itertools import permutations, product

    order = _ranks_by_node(cluster, p)
    c = team_size
    g = p // (c * c)
    if order is None or len(order) < 2 or g > len(order[0]):
        return []
    rings = [[(grp * g + i) * c + a for i in range(g)] for grp in range(c) for a in range(c)]
    n_rings = len(rings)
    if factorial(n_rings) <= MAX_SUBRING_ORDERS:
        orders = list(permutations(range(n_rings)))
    else:
        base = list(range(n_rings))
        orders = [tuple(base[i:] + base[:i]) for i in range(n_rings)]
        orders += [tuple(reversed(o)) for o in orders]
    nodes = list(range(len(order)))
    if factorial(len(nodes)) <= 6:
        node_orders = list(permutations(nodes))
    else:
        node_orders = [tuple(nodes[i:] + nodes[:i]) for i in nodes]
    out: list[tuple[int, ...]] = []
    for ring_order, node_order in product(orders, node_orders):
        m = [0] * p
        free = [list(order[n]) for n in node_order]
        queue = list(ring_order)
        for slots in free:  # whole sub-rings first, node by node
            while queue and len(slots) >= g:
                for logical in rings[queue.pop(0)]:
                    m[logical] = slots.pop(0)
        rest = [r for slots in free for r in slots]
        for logical in (x for i in queue for x in rings[i]):
            m[logical] = rest.pop(0)
        t = tuple(m)
        if t not in out:
            out.append(t)
    return out


def _ranks_by_node(cluster: ClusterSpec, p: int) -> list[list[int]] | None:
    """The CP ranks of each node, in node order; None unless every node holds as many."""
    ranks: dict[int, list[int]] = {}
    for r in range(p):
        ranks.setdefault(cluster.node(r), []).append(r)
    if len({len(v) for v in ranks.values()}) != 1:
        return None
    return [ranks[k] for k in sorted(ranks)]


def _laid(assignment: Sequence[int], order: list[list[int]], unit: int) -> tuple[int, ...]:
    """The map that puts item i (``unit`` consecutive logical ranks) on node
    ``assignment[i]``'s next free CP ranks."""
    fill = [0] * len(order)
    m: list[int] = []
    for node in assignment:
        m += order[node][fill[node] : fill[node] + unit]
        fill[node] += unit
    return tuple(m)


def exhaustive_map(
    cluster: ClusterSpec, shape: AttnShape, team_size: int, *, max_assignments: int = 20000
) -> tuple[tuple[int, ...], float, int]:
    """(map, predicted seconds, maps priced): the fastest map over every assignment of the
    logical ranks to nodes, each laid over its node's CP ranks in logical order (which
    ranks of a node run which logical ranks changes no link of the model, only which
    chunks of the sequence form each team and so the steps' causal work, a second-order
    term ``node_map``'s last phase searches and this does not). A check of ``node_map``'s
    search, not used by it: 5,775 maps at 3 x 4 ranks (~12 s here). ``ValueError`` where
    the nodes hold unequal numbers of CP ranks or there are more than ``max_assignments``
    assignments."""
    p = shape.cp_size
    order = _ranks_by_node(cluster, p)
    if order is None:
        raise ValueError("exhaustive_map needs every node to hold as many CP ranks")
    n, per = len(order), len(order[0])
    ways = _ways(p, n, per)
    if ways > max_assignments:
        raise ValueError(
            f"{ways} assignments of {p} ranks to {n} nodes of {per}: more than "
            f"max_assignments={max_assignments}"
        )
    best_map, best, count = (), float("inf"), 0
    for assignment in node_assignments(p, n, per):
        m = _laid(assignment, order, 1)
        cost = map_cost(cluster, shape, team_size, m)
        count += 1
        if cost < best:
            best_map, best = m, cost
    return best_map, best, count


def search_pays(cluster: ClusterSpec, cp_size: int, team_size: int) -> bool:
    """Whether ``node_map`` searches beyond the named placements: not on one node, not for
    ring (C = 1), and not where the CP ranks fill their nodes in order and the ``ring``
    placement's sub-rings (G = P/C^2 adjacent ranks) each lie inside one node (G divides the
    node size: the paper's case, where a named placement is the map to run)."""
    nodes = {cluster.node(r) for r in range(cp_size)}
    if len(nodes) == 1 or team_size == 1:
        return False
    g, gpn = cp_size // (team_size * team_size), cluster.gpus_per_node
    return bool(cluster.rank_nodes) or gpn % g != 0


def node_map(
    cluster: ClusterSpec, shape: AttnShape, team_size: int, *, max_evals: int = 600
) -> tuple[tuple[int, ...], float]:
    """(map, predicted seconds): the placement map for ``team_size`` on ``cluster``'s nodes
    (``ClusterSpec.node``) that the cost model predicts fastest among those the search
    reaches (module docstring) in at most ``max_evals`` evaluations after its starts.
    Deterministic (every rank that runs it on the same inputs gets the same map); never
    predicted slower than either named placement; where ``search_pays`` is False, the
    better named placement's map (on one node: ``team``'s, the first of equals)."""
    p = shape.cp_size
    named = _named_maps(p, team_size)
    if not search_pays(cluster, p, team_size):
        costs = [map_cost(cluster, shape, team_size, m) for m in named]
        i = min(range(len(named)), key=lambda j: (costs[j], j))
        return named[i], costs[i]
    best_map, best = None, float("inf")
    for m in [*named, *_starts(cluster, p, team_size), *_subring_starts(cluster, p, team_size)]:
        cost = map_cost(cluster, shape, team_size, m)
        if cost < best * (1 - 1e-9):
            best_map, best = m, cost
    for m in _team_starts(cluster, p, team_size):  # only where clearly faster (its doc)
        cost = map_cost(cluster, shape, team_size, m)
        if cost < best * (1 - TEAM_START_GAIN):
            best_map, best = m, cost
    current = list(best_map)
    c = team_size
    moves = [(i, j) for i in range(p) for j in range(i + 1, p)]  # rank swaps
    moves += [(-1 - t, -1 - u) for t in range(p // c) for u in range(t + 1, p // c)]  # teams

    def swap(i: int, j: int) -> bool:
        """Apply one move; False where it changes no node of any logical rank."""
        if i >= 0:
            if cluster.node(current[i]) == cluster.node(current[j]):
                return False
            current[i], current[j] = current[j], current[i]
            return True
        t, u = -1 - i, -1 - j
        a, b = current[t * c : t * c + c], current[u * c : u * c + c]
        if [cluster.node(r) for r in a] == [cluster.node(r) for r in b]:
            return False
        current[t * c : t * c + c], current[u * c : u * c + c] = b, a
        return True

    def swap_inside(i: int, j: int) -> bool:
        current[i], current[j] = current[j], current[i]
        return True

    def descend(pairs, apply, budget: int) -> None:
        """Keep each move of ``pairs`` that lowers the predicted time (``apply`` makes it,
        False where it changes nothing; applied again, it undoes itself), pass after pass,
        until a pass gains nothing or ``budget`` evaluations are spent."""
        nonlocal best
        evals, improved = 0, True
        while improved and evals < budget:
            improved = False
            for i, j in pairs:
                if not apply(i, j):
                    continue
                cost = map_cost(cluster, shape, team_size, tuple(current))
                evals += 1
                if cost < best * (1 - 1e-9):
                    best, improved = cost, True
                else:
                    apply(i, j)  # undo
                if evals >= budget:
                    break

    descend(moves, swap, max_evals)
    # then swaps inside a node: no link changes, but which CP ranks (which chunks of the
    # sequence) form a team does, and so the causal work of each step
    inside = [
        (i, j) for i, j in moves if i >= 0 and cluster.node(current[i]) == cluster.node(current[j])
    ]
    descend(inside, swap_inside, max_evals // 2)
    return tuple(current), best


def auto_map(
    rank_nodes: Sequence[int],
    team_size: int,
    shape: AttnShape | None = None,
    cluster: ClusterSpec | None = None,
) -> tuple[int, ...]:
    """The placement map ``placement="auto"`` runs: ``node_map`` on the CP ranks' nodes
    (``rank_nodes[r]``: CP rank r's node), with ``cluster``'s rates (default: the
    ``AUTO_CLUSTER`` preset's; its node layout is replaced by ``rank_nodes``) for
    ``shape`` (default ``AUTO_SHAPE``; its CP size must be ``len(rank_nodes)``)."""
    p = len(rank_nodes)
    if shape is None:
        shape = AttnShape(p, **AUTO_SHAPE, elem_bytes=2, acc_bytes=4, causal=True)
    if shape.cp_size != p:
        raise ValueError(f"shape.cp_size={shape.cp_size} must be the CP size {p}")
    from ..schedule.layout import nodes_from_hosts

    base = cluster if cluster is not None else CLUSTER_PRESETS[AUTO_CLUSTER]
    nodes = nodes_from_hosts(rank_nodes)
    per_node = max(nodes.count(n) for n in set(nodes))
    cl = base.with_(gpus_per_node=per_node, num_nodes=max(nodes) + 1, rank_nodes=nodes)
    return node_map(cl, shape, team_size)[0]


def format_map(placement: Sequence[int], team_size: int, rank_nodes: Sequence[int]) -> str:
    """A picture of a map: one line per node, its CP ranks with the logical coordinate
    (team.member) each runs and the sub-ring it belongs to, e.g.
    ``node 0: r0=t0.0/s0 r1=t0.1/s1 ...``."""
    from ..schedule.layout import StarTrailLayout

    p = len(placement)
    lay = StarTrailLayout(p, team_size, tuple(placement))
    subrings = {r: i for i, ranks in enumerate(lay.all_subring_ranks()) for r in ranks}
    lines = []
    for n in sorted(set(rank_nodes)):
        cells = []
        for r in (r for r in range(p) if rank_nodes[r] == n):
            t, a = lay.coord(r)
            cells.append(f"r{r}=t{t}.{a}/s{subrings[r]}")
        lines.append(f"node {n}: " + " ".join(cells))
    return "\n".join(lines)


def map_strategies(
    cluster: ClusterSpec, shape: AttnShape, candidates, *, max_evals: int = 200
) -> list:
    """A computed map for every StarTrail and 2-D split (C > 1, U) among ``candidates``
    (``strategies.Strategy``) where the search pays (``search_pays``): ``node_map`` on the
    CP ranks (the split: on its ring group, ``times.ring_cluster``, with the shape after
    the all-to-all), kept where it is predicted faster than both named placements;
    ``max_evals`` bounds each search (``startrail-plan`` prices many combinations)."""
    from .strategies import Strategy, split_parts
    from .times import ring_cluster

    out, seen = [], set()
    for st in candidates:
        key = (st.kind, st.team_size, st.ulysses_size)
        if st.kind not in ("startrail", "split") or st.team_size == 1 or key in seen:
            continue
        seen.add(key)
        if st.kind == "startrail":
            cl, sh = cluster, shape
        else:
            cl, sh = ring_cluster(cluster, st.ulysses_size), split_parts(st, shape)[1]
        if not search_pays(cl, sh.cp_size, st.team_size):
            continue
        m, _ = node_map(cl, sh, st.team_size, max_evals=max_evals)
        # node_map leaves the named placements only for a map predicted strictly faster
        if m not in _named_maps(sh.cp_size, st.team_size):
            out.append(Strategy(st.kind, st.team_size, m, st.ulysses_size))
    return out
