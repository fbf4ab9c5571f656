"""Attention forward and backward time of each strategy: links, kernels and the ring pipeline.

StarTrail forward = team all-gather q,k,v + initial KV placement + G ring
steps (a pipeline with the schedule's dependencies, ``ring_pipeline``; with equal
compute, step s: max(compute_s, send KV) with overlap, their sum without) +
team combine (lse all-gather, out reduce-scatter). Backward = dout/delta
all-gather + initial placement + G steps (KV and dK/dV in flight) + the dK/dV
return + dq,dk,dv reduce-scatter. All-gather-KV and Ulysses expose their
collectives (no overlap), as their reference implementations do by default.
"""

from __future__ import annotations

from dataclasses import replace

from ..accounting import startrail_comm_bytes
from ..layout import StarTrailLayout
from .cluster import ClusterSpec
from .compute import allgather_call_shapes, call_work, kernel_time, startrail_work
from .links import all_to_all, collective, p2p_step, reduce_scatter_extra
from .shape import AttnShape

__all__ = ["allgather_times", "ring_pipeline", "startrail_times", "ulysses_times"]

Bytes = list[dict[str, int]]
"""Per rank: the ``accounting`` byte counts (``strategies.comm_bytes``)."""


def ring_pipeline(
    cl: ClusterSpec,
    comp: list[list[float]],
    prev: list[int],
    x_kv: float,
    x_dkv: float = 0.0,
) -> float:
    """Makespan of the sub-ring steps with the schedule's real dependencies.

    ``comp[s][r]``: rank r's kernel time at step s; ``prev[r]``: its ring predecessor.
    A transfer completes ``x`` after both its ends have posted it, and a rank's wait
    covers its send and its receive (``P2PHandle.wait``). Forward (``attention.startrail_rank_forward``):
    rank r posts the next KV exchange when it starts step s-1, and starts step s once it
    has finished step s-1 and that exchange (KV to its successor, from its predecessor)
    is done. Backward (``x_dkv > 0``, ``startrail_rank_backward``): KV travels as in the forward; after
    computing step s, rank r waits for the dK/dV exchange it posted when it ended step
    s-1 (its partial to the successor, the predecessor's to it), adds it, and posts the
    next. Ranks thus do not meet at every step: a rank that holds a causal diagonal
    block at one step and full blocks at the others pays its own sum, not the per-step
    maximum over ranks. Without ``cl.overlap`` the transfers take the ranks' own time
    (gloo's threads share the cores): each step but the last costs compute +
    ``max(x_kv, x_dkv)``, and a transfer is done once both its ends have posted it (its
    time is in their steps already). With equal compute everywhere the makespan is
    exactly ``sum_s max(compute_s, transfer_s)`` with overlap, ``sum_s (compute_s +
    transfer_s)`` without.
    """
    g, p = len(comp), len(comp[0])
    nxt = [0] * p
    for r, q in enumerate(prev):
        nxt[q] = r

    def done(posted: list[float], r: int, x: float) -> float:
        return max(posted[prev[r]], posted[r], posted[nxt[r]]) + (x if cl.overlap else 0.0)

    own = max(x_kv, x_dkv)
    start, end = [0.0] * p, [0.0] * p
    for s in range(g):
        if s > 0:
            start = [max(end[r], done(start, r, x_kv)) for r in range(p)]
        busy = 0.0 if cl.overlap or s == g - 1 else own
        new_end = [start[r] + comp[s][r] + busy for r in range(p)]
        if s > 0 and x_dkv:
            new_end = [max(new_end[r], done(end, r, x_dkv)) for r in range(p)]
        end = new_end
    return max(end)


def startrail_times(lay: StarTrailLayout, cl: ClusterSpec, shape: AttnShape, byts: Bytes):
    """(fwd, bwd, team all-gather of q,k,v) seconds for StarTrail / ring."""
    p = shape.cp_size
    no_acc = replace(shape.local, acc_bytes=0)  # the q,k,v all-gather: input dtype only
    qkv = max(startrail_comm_bytes(lay, r, no_acc)["fwd_collective"] for r in range(p))
    teams = lay.all_team_ranks()
    team_kv = lay.team_size * 2 * shape.s_local * shape.batch * shape.heads_kv * shape.head_dim
    kv_msg = team_kv * shape.elem_bytes
    dkv_msg = team_kv * shape.acc_bytes
    work = startrail_work(lay, shape.causal, shape.s_local, shape.packed, shape.varlen, shape.band)
    g = lay.ring_size

    def init_step() -> float:
        return p2p_step(cl, [(r, lay.initial_send_peer(r), kv_msg) for r in range(p)])

    def ring_step(msg: int) -> float:
        return p2p_step(cl, [(r, lay.ring_next(r), msg) for r in range(p)])

    def comp(bwd: bool) -> list[list[float]]:
        return [[kernel_time(cl, shape, pr, nc, bwd, sh) for pr, nc, sh in row] for row in work]

    prev = [lay.ring_prev(r) for r in range(p)]

    # Forward
    t_qkv = collective(cl, teams, qkv, 1)
    fwd_coll = max(b["fwd_collective"] for b in byts)
    t_comb = collective(cl, teams, fwd_coll - qkv, 2)
    uq = shape.s_local * shape.batch * shape.heads_q * shape.head_dim
    ukv = shape.s_local * shape.batch * shape.heads_kv * shape.head_dim
    c1 = lay.team_size - 1
    t_comb += reduce_scatter_extra(cl, teams, c1 * uq * shape.acc_bytes)  # out
    fwd = t_qkv + init_step() + t_comb
    fwd += ring_pipeline(cl, comp(False), prev, ring_step(kv_msg) if g > 1 else 0.0)
    # Backward
    bwd_coll = max(b["bwd_collective"] for b in byts)
    bwd = collective(cl, teams, bwd_coll, 3) + init_step()
    bwd += reduce_scatter_extra(cl, teams, c1 * (uq + 2 * ukv) * shape.acc_bytes)  # dq,dk,dv
    x = ring_step(kv_msg + dkv_msg) if g > 1 else 0.0  # KV and dK/dV share the link
    bwd += ring_pipeline(cl, comp(True), prev, x, x)
    ret = [(r, lay.dkv_return_peers(r)[0], dkv_msg) for r in range(p)]
    bwd += p2p_step(cl, ret)
    return fwd, bwd, t_qkv


def allgather_times(cl: ClusterSpec, shape: AttnShape, byts: Bytes):
    """(fwd, bwd, 0) seconds for all-gather-KV: its collectives exposed, then its calls."""
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
    return fwd, bwd, 0.0


def ulysses_times(cl: ClusterSpec, shape: AttnShape, byts: Bytes):
    """(fwd, bwd, 0) seconds for Ulysses: its all-to-alls exposed, then one call over the
    whole sequence with heads/P heads."""
    p = shape.cp_size
    b = byts[0]
    n = shape.seq_len
    whole = ((n, n, shape.causal),)
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
    return fwd, bwd, 0.0
