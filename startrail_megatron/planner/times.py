"""Attention forward and backward time of each strategy: links, kernels and the ring pipeline.

Each overlap charged here is one the code makes (``attention.py``'s Note [overlap];
the line of ``startrail_rank_forward`` / ``_backward`` is named beside each term), and
only when ``cl.overlap``; otherwise the terms add up, but for the ring pipeline on host
cores every rank shares (``cl.host_cores``, an emulated cluster: wire time overlapped,
host work added to compute). StarTrail forward = max(q
all-gather less the first step's calls on the rank's own rows (``split_own_rows``: they
run before the wait), initial KV placement: each member's K,V to the C first holders, a
fan-out) (started together) + G ring steps (a pipeline with the schedule's dependencies,
``ring_pipeline``; with equal compute, step s: max(compute_s, send KV) with overlap,
their sum without; under a window only the steps a sub-ring computes, the KV jumping past
idle ones: ``schedule.startrail_active_steps``) + team combine (lse all-gather, out
reduce-scatter; per head group of the last step, all but the last group's hidden behind
the next group's compute).
Backward = max(dout and delta all-gathers less the own rows' calls, initial placement) + G
steps (KV and dK/dV in flight) + max(dq reduce-scatter, the dK/dV parts sent home: a fan-in), the dq
reduce-scatter per head group of the last step as the forward's combine. Nothing
overlaps the layer's QKV projection (the code does not split it). All-gather-KV and Ulysses
expose their collectives (no overlap), as their reference implementations do by
default.
"""

from __future__ import annotations

from ..accounting import split_all_to_all_bytes
from ..schedule import splits_first_step, tail_head_groups
from ..schedule.layout import StarTrailLayout
from .cluster import ClusterSpec
from .compute import (
    allgather_call_shapes,
    call_work,
    kernel_time,
    startrail_own_shapes,
    startrail_work,
    ulysses_call_shapes,
)
from .links import all_to_all, collective, p2p_fan, p2p_host_cpu, p2p_step, reduce_scatter_extra
from .shape import AttnShape

__all__ = [
    "allgather_times",
    "ring_cluster",
    "ring_pipeline",
    "split_times",
    "startrail_times",
    "step_kernel_seconds",
    "ulysses_times",
]

Bytes = list[dict[str, int]]
"""Per rank: the ``accounting`` byte counts (``strategies.comm_bytes``)."""


def ring_pipeline(
    cl: ClusterSpec,
    comp: list[list[float]],
    prev: list[int],
    x_kv: float,
    x_dkv: float = 0.0,
    cpu_kv: float = 0.0,
    cpu_dkv: float = 0.0,
) -> float:
    """Makespan of the sub-ring steps with the schedule's real dependencies.

    ``comp[s][r]``: rank r's kernel time at step s; ``prev[r]``: its ring predecessor.
    A transfer completes ``x`` after both its ends have posted it, and a rank's wait
    covers its send and its receive (``P2PHandle.wait``). Forward (``rank.forward.startrail_rank_forward``):
    rank r posts the next KV exchange when it starts step s-1, and starts step s once it
    has finished step s-1 and that exchange (KV to its successor, from its predecessor)
    is done. Backward (``x_dkv > 0``, ``startrail_rank_backward``): KV travels as in the forward; after
    computing step s, rank r waits for the dK/dV exchange it posted when it ended step
    s-1 (its partial to the successor, the predecessor's to it), adds it, and posts the
    next (``rank.dkv.StepDkvSum``: the step's gradients are kept until then and added into
    what it received). Ranks thus do not meet at every step: a rank that holds a causal diagonal
    block at one step and full blocks at the others pays its own sum, not the per-step
    maximum over ranks. Without ``cl.overlap`` the transfers take the ranks' own time
    (gloo's threads share the cores): each step but the last costs compute +
    ``max(x_kv, x_dkv)``, and a transfer is done once both its ends have posted it (its
    time is in their steps already). With equal compute everywhere the makespan is
    exactly ``sum_s max(compute_s, transfer_s)`` with overlap, ``sum_s (compute_s +
    transfer_s)`` without.

    Where the ranks share the host's cores (``cl.host_cores``: an emulated cluster), a
    transfer's wire time overlaps compute, but its host work does not: a step's compute
    grows by ``cpu_kv`` while a KV exchange is in flight beside it (every step but the
    last) and by ``cpu_dkv`` while a dK/dV one is (every step but the first, backward);
    ``links.p2p_host_cpu``.
    """
    g, p = len(comp), len(comp[0])
    nxt = [0] * p
    for r, q in enumerate(prev):
        nxt[q] = r

    pipelined = cl.overlap or cl.host_cores > 0

    def done(posted: list[float], r: int, x: float) -> float:
        return max(posted[prev[r]], posted[r], posted[nxt[r]]) + (x if pipelined else 0.0)

    own = max(x_kv, x_dkv)
    start, end = [0.0] * p, [0.0] * p
    for s in range(g):
        if s > 0:
            start = [max(end[r], done(start, r, x_kv)) for r in range(p)]
        if cl.overlap and not cl.host_cores:
            busy = 0.0
        elif pipelined:  # the host work of the transfers in flight beside this step
            busy = (cpu_kv if s < g - 1 else 0.0) + (cpu_dkv if s > 0 and x_dkv else 0.0)
        else:
            busy = 0.0 if s == g - 1 else own
        new_end = [start[r] + comp[s][r] + busy for r in range(p)]
        if s > 0 and x_dkv:
            new_end = [max(new_end[r], done(end, r, x_dkv)) for r in range(p)]
        end = new_end
    return max(end)


def step_kernel_seconds(
    lay: StarTrailLayout, cl: ClusterSpec, shape: AttnShape, work: tuple, bwd: bool
) -> list[list[float]]:
    """[step][rank] kernel seconds of StarTrail's calls (``work``: ``compute.startrail_work``
    for this layout and shape). A rank's last computed step makes its calls once per head
    group (``tail_head_groups``): the same pairs in as many times the calls."""
    k_tail = len(tail_head_groups(lay, shape.heads_q, shape.heads_kv, False))
    active = shape.active_steps(lay)
    last = [lay.computed_steps(r, active)[-1] for r in range(shape.cp_size)]
    return [
        [
            kernel_time(cl, shape, pr, nc * (k_tail if s == last[r] else 1), bwd, sh)
            for r, (pr, nc, sh) in enumerate(row)
        ]
        for s, row in enumerate(work)
    ]


def startrail_times(lay: StarTrailLayout, cl: ClusterSpec, shape: AttnShape, byts: Bytes):
    """(fwd, bwd) seconds for StarTrail / ring."""
    p = shape.cp_size
    c1 = lay.team_size - 1
    teams = lay.all_team_ranks()
    uq = shape.s_local * shape.batch * shape.heads_q * shape.head_dim
    ukv = shape.s_local * shape.batch * shape.heads_kv * shape.head_dim
    rows = shape.s_local * shape.batch * shape.heads_q  # one lse / delta per row and head
    e, a = shape.elem_bytes, shape.acc_bytes
    team_kv = lay.team_size * 2 * ukv
    kv_msg, dkv_msg = team_kv * e, team_kv * a
    key, orf = (lay, shape.causal, shape.s_local, shape.packed), cl.own_rows_first
    # the code's rule (``RankCall.splits_first_step``); the planner models no dropout
    hosts = max(len({cl.node(r) for r in team}) for team in lay.all_team_ranks())
    orf = splits_first_step(
        lay, packed=shape.packed is not None, dropout=False, setting=orf,
        heads_q=shape.heads_q, heads_kv=shape.heads_kv, team_hosts=hosts,
    )  # fmt: skip
    work = startrail_work(*key, shape.varlen, shape.band, orf)
    g = lay.ring_size

    def both(x: float, y: float) -> float:
        """Two transfers started together: the longer with overlap, the sum without."""
        return max(x, y) if cl.overlap else x + y

    def gather(nbytes: int) -> float:
        return collective(cl, teams, nbytes, 1)

    def scatter(nbytes: int) -> float:
        return gather(nbytes) + reduce_scatter_extra(cl, teams, nbytes)

    active = shape.active_steps(lay)

    def jumps(msg: int) -> list[list[tuple[int, int, int]]]:
        """The sends of a ring step (one list), or of each jump length past idle steps
        that the sub-rings make (each length's pairs at once)."""
        if active is None:
            return [[(r, lay.ring_next(r), msg) for r in range(p)]]
        hops = {b - a for steps in active for a, b in zip(steps, steps[1:])}
        return [[(r, lay.ring_shift(r, k), msg) for r in range(p)] for k in sorted(hops)]

    def jump(msg: int) -> float:
        """A ring step, or a hop past idle steps: the slowest of the jumps."""
        return max((p2p_step(cl, sends) for sends in jumps(msg)), default=0.0)

    def jump_cpu(msg: int) -> float:
        """The host work of ``jump(msg)`` (``links.p2p_host_cpu``): the largest jump's."""
        return max((p2p_host_cpu(cl, sends) for sends in jumps(msg)), default=0.0)

    def pipeline(
        work: list[list[float]], x_kv: float, x_dkv: float = 0.0, cpu: tuple = (0.0, 0.0)
    ) -> float:
        """``ring_pipeline`` over the steps each sub-ring computes (all of them without
        idle steps): one pipeline per sub-ring on its computed steps, the slowest wins."""
        if active is None:
            return ring_pipeline(cl, work, prev, x_kv, x_dkv, *cpu)
        worst = 0.0
        for i, ranks in enumerate(lay.all_subring_ranks()):
            where = {r: j for j, r in enumerate(ranks)}
            sub = [[work[s][r] for r in ranks] for s in active[i]]
            sub_prev = [where[lay.ring_prev(r)] for r in ranks]
            worst = max(worst, ring_pipeline(cl, sub, sub_prev, x_kv, x_dkv, *cpu))
        return worst

    k_tail = len(tail_head_groups(lay, shape.heads_q, shape.heads_kv, False))

    def comp(bwd: bool) -> list[list[float]]:
        return step_kernel_seconds(lay, cl, shape, work, bwd)

    def fan(targets, nbytes: int) -> float:
        return p2p_fan(cl, [(r, d, nbytes) for r in range(p) for d in targets(r)])

    def tail(t_coll: float, work: list[list[float]]) -> float:
        """Team collectives of the last step's head groups (``tail_head_groups``): all but
        the last group's travel while the next group computes."""
        if k_tail == 1 or not cl.overlap:
            return t_coll
        t_last = max(work[lay.computed_steps(r, active)[-1]][r] for r in range(p))
        return t_coll - min(t_coll, t_last) * (k_tail - 1) / k_tail

    comp_f, comp_b = comp(False), comp(True)
    t_init = fan(lambda r: lay.placement_targets(r, active), 2 * ukv * e)
    prev = [lay.ring_prev(r) for r in range(p)]
    own = [call_work(x) for x in startrail_own_shapes(*key, shape.band, orf)]

    def first(t_gather: float, bwd: bool) -> float:
        """A team gather and the placement, started together: each rank waits the
        placement, makes its first step's calls on its own rows (``split_own_rows``; their
        time is in the pipeline's first step), then waits the gather."""
        if not cl.overlap:
            return t_gather + t_init
        return max(
            max(t_init, t_gather - (kernel_time(cl, shape, pr, nc, bwd, sh) if nc else 0.0))
            for pr, nc, sh in own
        )

    # Forward: ring.start_placement(kv_local); q_gather = all_gather_start(q); the own
    # rows' calls (plan.own); q_gather.wait() ...
    fwd = first(gather(c1 * uq * e), False)
    fwd += pipeline(comp_f, jump(kv_msg) if g > 1 else 0.0, cpu=(jump_cpu(kv_msg), 0.0))
    # lse all-gather, out reduce-scatter: per head group of the last step (TeamCombine);
    # all but the last group's travel while the next group computes (tail_head_groups)
    fwd += tail(gather(c1 * lay.team_size * rows * a) + scatter(c1 * uq * a), comp_f)
    # Backward: dout_gather, delta_gather = all_gather_start(...);
    # ring.start_placement(kv_local); the own rows' calls with local dout and delta;
    # dout_gather.wait(), delta_gather.wait() ...
    bwd = first(gather(c1 * (uq * e + rows * a)), True)
    x = jump(kv_msg + dkv_msg) if g > 1 else 0.0  # KV and dK/dV share the link
    bwd += pipeline(comp_b, x, x, cpu=(jump_cpu(kv_msg), jump_cpu(dkv_msg)))
    home = fan(lambda r: lay.dkv_home_targets(r, active), 2 * ukv * a)
    # dq's reduce-scatter per head group of the last step (dq_scatters in the backward): all but
    # the last group's travel while the next group computes, the rest beside the parts
    bwd += both(tail(scatter(c1 * uq * a), comp_b), home)
    return fwd, bwd


def allgather_times(cl: ClusterSpec, shape: AttnShape, byts: Bytes):
    """(fwd, bwd) seconds for all-gather-KV: its collectives exposed, then its calls."""
    p = shape.cp_size
    b = byts[0]
    everyone = [list(range(p))]
    work = [call_work(allgather_call_shapes(r, shape)) for r in range(p)]
    fwd_c = max(kernel_time(cl, shape, pr, n, False, sh) for pr, n, sh in work)
    bwd_c = max(kernel_time(cl, shape, pr, n, True, sh) for pr, n, sh in work)
    fwd = collective(cl, everyone, b["fwd_collective"], 1) + fwd_c
    bwd = collective(cl, everyone, b["bwd_collective"], 2) + bwd_c
    dkv = (p - 1) * 2 * shape.s_local * shape.batch * shape.heads_kv * shape.head_dim
    bwd += reduce_scatter_extra(cl, everyone, dkv * shape.acc_bytes)
    return fwd, bwd


def ulysses_times(cl: ClusterSpec, shape: AttnShape, byts: Bytes):
    """(fwd, bwd) seconds for Ulysses: its all-to-alls exposed, then one call over the
    whole sequence with heads/P heads."""
    p = shape.cp_size
    b = byts[0]
    whole = ulysses_call_shapes(shape)
    pairs, calls, _ = call_work(whole)
    local = (
        AttnShape(
            p,
            shape.s_local,
            shape.batch,
            shape.heads_q // p,
            shape.heads_kv // p,
            shape.head_dim,
            shape.elem_bytes,
            shape.acc_bytes,
            shape.causal,
        )
        if p > 1
        else shape
    )
    fwd = all_to_all(cl, p, b["fwd_collective"], 4)
    fwd += kernel_time(cl, local, pairs, calls, False, whole)
    bwd = all_to_all(cl, p, b["bwd_collective"], 4)
    bwd += kernel_time(cl, local, pairs, calls, True, whole)
    return fwd, bwd


def ring_cluster(cl: ClusterSpec, ulysses_size: int) -> ClusterSpec:
    """The cluster one ring group of the 2-D split sees (``schedule/ulysses.py``'s Note):
    ring rank j is CP rank ``j*U + u``, so a node holds ``max(1, gpus_per_node // U)`` of
    its ranks, consecutive; the U ring groups of a node send off-node at once, so each
    gets that share of the node's ``inter_bw``, and on shared host cores the host work of
    all U groups' transfers slows each (``host_cpu_*`` x U). (U and gpus_per_node are taken
    to divide one another, as in every preset.)"""
    gpn = cl.gpus_per_node
    per_node = max(1, gpn // ulysses_size)
    return cl.with_(
        gpus_per_node=per_node,
        num_nodes=cl.num_nodes * (gpn // per_node),
        inter_bw=cl.inter_bw * per_node / gpn,
        host_cpu_intra=cl.host_cpu_intra * ulysses_size,
        host_cpu_inter=cl.host_cpu_inter * ulysses_size,
    )


def split_times(lay, cl: ClusterSpec, shape: AttnShape, ring_shape: AttnShape):
    """(fwd, bwd) seconds of the 2-D split (``lay``: a ``UlyssesLayout``): its four
    all-to-alls over U consecutive ranks each way, exposed (started together and waited on
    before StarTrail starts: ``attention._ulysses_startrail``), plus StarTrail over R ranks
    on ``ring_shape`` (the shape after the all-to-all) and ``ring_cluster``."""
    u = lay.ulysses_size
    fwd, bwd = startrail_times(lay.ring, ring_cluster(cl, u), ring_shape, [])
    a2a = all_to_all(cl, u, split_all_to_all_bytes(lay, shape.local), 4, shape.cp_size // u)
    return fwd + a2a, bwd + a2a
