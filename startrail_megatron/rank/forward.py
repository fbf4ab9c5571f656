"""One rank's StarTrail forward (``attention.py``'s docstring: bytes; Note [overlap]: what
each transfer hides behind)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import AttentionKernel, acc_dtype
from ..schedule import ALL_HEADS
from .call import RankCall
from .combine import TeamCombine
from .joint_keys import joint_forward
from .kernel_calls import kernel_options, row_forward, varlen_forward
from .kv_ring import KVRing

__all__ = ["startrail_rank_forward"]


def startrail_rank_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rc: RankCall,
    scale: float,
    kernel: AttentionKernel,
    sinks: Tensor | None = None,
    joint: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """One rank's forward: (out ``[s, b, hq, d]`` in q's dtype, what the backward needs).

    The saved tuple is (q_team, kv_local, lse_team): the team's queries in team order,
    this rank's own K,V stacked ``[s, 2, b, hkv, d]`` (the backward places it again) and
    the rows' merged log-sum-exp. ``sinks`` (one logit per query head) enter once, in the
    team combine: ``lse = logaddexp(lse, sink)``. ``joint``: keys and values
    ``[t, b, hkv, d]`` the same on every CP rank (MMDiT text tokens), which every (real)
    query sees once: each rank adds them to its own rows before the team combine.
    """
    C = rc.layout.team_size
    s, b, hq, d = q.shape
    softcap = rc.options.softcap
    order = rc.team_order
    # 1-2. The initial K,V placement (each member's K,V straight to its team's C first
    # holders) and the team all-gather of q, in flight together (Note [overlap]).
    kv_local = torch.stack((k, v), dim=1)  # [s, 2, b, hkv, d]: kept for the backward
    ring = KVRing(rc, order, rc.active_steps(s))
    ring.start_placement(kv_local)
    q_gather = rc.team_comm.all_gather_start(q, "q_team")
    combine = TeamCombine(rc, order, q, C * s, k.shape[2], acc_dtype(q.dtype), sinks)
    if joint is not None:  # local rows only: computed while the transfers are in flight
        joint_forward(rc, order, q, joint, combine.out, combine.lse, scale, kernel)
    q_team = None if C > 1 else q.contiguous()  # gathered below, at the first step
    split = rc.splits_first_step(hq, k.shape[2])
    last = len(ring.steps) - 1
    # 3. The sub-ring steps (those with work), the next K,V in flight while this one
    # computes (``KVRing.held``). The last step runs head group by head group
    # (``TeamCombine``): each group's combine starts as soon as its heads are done and
    # runs while the next group computes.
    for i, step, kv in ring.held(kv_local):  # kv: [n, 2, b, hkv, d], team order
        plan = rc.plan(step, s, kernel, own_first=split and q_team is None)
        if q_team is None:  # the first step's calls on this rank's own rows, then the rest
            for own in plan.own:  # local queries: while the others' arrive
                c = own.call
                row_forward(
                    kernel, q[own.local_q_rows], kv[c.kv_rows, 0], kv[c.kv_rows, 1],
                    combine.out[c.q_rows], combine.lse[..., c.q_rows], c.causal, scale,
                    kernel_options(softcap, None, c),
                )  # fmt: skip
            q_team = order.to_team(q_gather.wait(), in_place=True)  # no second team q
        for g, (qh, kh) in enumerate(combine.groups if i == last else ALL_HEADS):
            q_g, kv_g = q_team[:, :, qh], kv[:, :, :, kh]
            out_g, lse_g = combine.out[:, :, qh], combine.lse[:, qh]
            for j, call in enumerate(plan.varlen):
                drop = rc.dropouts.at(step, j)
                varlen_forward(
                    kernel, call, q_g, kv_g, out_g, lse_g, scale, kernel_options(softcap, drop)
                )
            for j, c in enumerate(plan.rows):
                row_forward(
                    kernel, q_g[c.q_rows], kv_g[c.kv_rows, 0], kv_g[c.kv_rows, 1],
                    out_g[c.q_rows], lse_g[..., c.q_rows], c.causal, scale,
                    kernel_options(softcap, rc.dropouts.at(step, j), c),
                )  # fmt: skip
            del q_g, kv_g, out_g, lse_g  # views keep their bases alive
            if i == last:
                combine.done(g)  # start this group's combine, finish the one before
    del kv
    # 4. The team combine's end: the last group's lse and out (the accumulators are
    # freed once the last group's rows are copied out).
    out, lse_team = combine.result()
    return out.to(q.dtype), (q_team, kv_local, lse_team)
