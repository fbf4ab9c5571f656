"""Link timing: P2P steps, ring collectives and all-to-alls on a cluster.

Time of one transfer: ``alpha + bytes / bw`` (Hockney). A P2P step takes
its slowest rank; a link is intra-node or inter-node by the placement, and
the GPUs of a node that send off-node at once share the node's network
bandwidth. A ring collective over n ranks takes ``(n-1) alpha + bytes/bw``
with ``bytes`` the ledger's per-rank volume and ``bw`` its slowest ring edge;
an all-to-all ``(n-1) alpha`` plus its intra-node and inter-node shares, the latter at
``all_to_all_inter_bw`` per node where the cluster gives one (a measured all-to-all).

Where every rank shares the host's cores (``ClusterSpec.host_cores``: an emulated cluster),
the host work of all the bytes moving at once (``p2p_host_cpu``) bounds each of these too:
a transfer takes the longer of its wire time and its host CPU over the cores.
"""

from __future__ import annotations

from .cluster import ClusterSpec

__all__ = [
    "all_to_all", "collective", "p2p_fan", "p2p_host_cpu", "p2p_step", "reduce_scatter_extra",
]  # fmt: skip


def _inter_bw(cl: ClusterSpec, senders: int, node_bw: float = 0.0) -> float:
    """Inter-node bandwidth of one GPU while ``senders`` GPUs of its node send off-node,
    sharing ``node_bw`` (default: ``inter_bw``)."""
    return min(cl.inter_bw_per_gpu, (node_bw or cl.inter_bw) / max(senders, 1))


def p2p_step(cl: ClusterSpec, sends: list[tuple[int, int, int]]) -> float:
    """One P2P step, every (src, dst, bytes) at once: the slowest sender's time (or the host
    work of them all, where longer)."""
    off: dict[int, int] = {}
    for s, d, b in sends:
        if b and cl.node(s) != cl.node(d):
            off[cl.node(s)] = off.get(cl.node(s), 0) + 1
    t = 0.0
    for s, d, b in sends:
        if not b or s == d:
            continue
        if cl.node(s) == cl.node(d):
            t = max(t, cl.intra_latency + b / cl.intra_bw)
        else:
            t = max(t, cl.inter_latency + b / _inter_bw(cl, off[cl.node(s)]))
    return max(t, p2p_host_cpu(cl, sends))


def p2p_host_cpu(cl: ClusterSpec, sends: list[tuple[int, int, int]]) -> float:
    """Seconds the host work of one P2P step, every (src, dst, bytes) at once, takes from
    each rank's compute where all ranks share ``cl.host_cores`` cores (0 elsewhere): the
    host CPU of all its bytes (``host_cpu_intra`` / ``_inter`` per byte) over the cores."""
    if not cl.host_cores:
        return 0.0
    cpu = sum(
        b * (cl.host_cpu_intra if cl.node(s) == cl.node(d) else cl.host_cpu_inter)
        for s, d, b in sends
        if s != d
    )
    return cpu / cl.host_cores


def p2p_fan(cl: ClusterSpec, sends: list[tuple[int, int, int]]) -> float:
    """Several (src, dst, bytes) messages per rank at once (the placement's fan-out, the
    dK/dV fan-in home): a rank's messages share its link, so it takes the sum of its
    bytes on each kind of link; the slowest rank's time."""
    per: dict[int, list[tuple[int, int]]] = {}
    for s, d, b in sends:
        if b and s != d:
            per.setdefault(s, []).append((d, b))
    off: dict[int, int] = {}
    for s, msgs in per.items():
        if any(cl.node(d) != cl.node(s) for d, _ in msgs):
            off[cl.node(s)] = off.get(cl.node(s), 0) + 1
    t = 0.0
    for s, msgs in per.items():
        intra = sum(b for d, b in msgs if cl.node(d) == cl.node(s))
        inter = sum(b for d, b in msgs if cl.node(d) != cl.node(s))
        if intra:
            t = max(t, cl.intra_latency + intra / cl.intra_bw)
        if inter:
            t = max(t, cl.inter_latency + inter / _inter_bw(cl, off[cl.node(s)]))
    return max(t, p2p_host_cpu(cl, sends))


def collective(cl: ClusterSpec, groups: list[list[int]], nbytes: int, calls: int) -> float:
    """Ring collectives on every group at once; ``nbytes`` = per-rank volume sent."""
    if not nbytes:
        return 0.0
    off: dict[int, int] = {}
    edges = []
    for g in groups:
        n = len(g)
        e = [(g[i], g[(i + 1) % n]) for i in range(n)] if n > 1 else []
        edges.append(e)
        for s, d in e:
            if cl.node(s) != cl.node(d):
                off[cl.node(s)] = off.get(cl.node(s), 0) + 1
    t = 0.0
    for g, e in zip(groups, edges):
        if not e:
            continue
        inter = [s for s, d in e if cl.node(s) != cl.node(d)]
        bw = min([cl.intra_bw] + [_inter_bw(cl, off[cl.node(s)]) for s in inter])
        alpha = cl.inter_latency if inter else cl.intra_latency
        t = max(t, calls * (len(g) - 1) * alpha + nbytes / bw)
    # every rank sends its volume to its ring successor
    return max(t, p2p_host_cpu(cl, [(s, d, nbytes) for e in edges for s, d in e]))


def all_to_all(cl: ClusterSpec, p: int, nbytes: int, calls: int, groups: int = 1) -> float:
    """All-to-all over CP ranks 0..p-1; ``nbytes`` = per-rank volume sent; ``groups``: as
    many groups making theirs at once (their host work shares the host's cores)."""
    if p == 1 or not nbytes:
        return 0.0
    local = min(cl.gpus_per_node, p)
    n_in, n_out = local - 1, p - local
    per_peer = nbytes / (p - 1)
    t_in = n_in * per_peer / cl.intra_bw
    # many flows on the node's link at once: its measured all-to-all rate, where given
    t_out = n_out * per_peer / _inter_bw(cl, local, cl.all_to_all_inter_bw) if n_out else 0.0
    host = groups * p2p_host_cpu(
        cl, [(r, q, per_peer) for r in range(p) for q in range(p) if q != r]
    )
    latency = calls * (n_in * cl.intra_latency + n_out * cl.inter_latency)
    return max(latency + max(t_in, t_out), host)


def reduce_scatter_extra(cl: ClusterSpec, groups: list[list[int]], nbytes: int) -> float:
    """What a reduce-scatter of ``nbytes`` (ledger volume) costs beyond a ring collective of
    that volume: on gloo (an all-reduce of the whole input) as much again."""
    return collective(cl, groups, nbytes, 1) if cl.reduce_scatter_via_allreduce else 0.0
