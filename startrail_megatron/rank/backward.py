"""One rank's StarTrail backward: K,V travels the forward's ring again, its dK/dV partial
sums one step behind it, then home (``attention.py``'s docstring: bytes; Note [overlap]:
what each transfer hides behind)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import AttentionKernel, acc_dtype
from ..schedule import ALL_HEADS, tail_head_groups
from .call import RankCall
from .dkv import StepDkvSum
from .joint_keys import joint_backward
from .kernel_calls import kernel_options, row_backward, varlen_backward
from .kv_ring import KVRing

__all__ = ["RankGrads", "startrail_rank_backward"]


@dataclass(frozen=True)
class RankGrads:
    """One rank's gradients: dq, dk, dv of its local rows (dout's dtype); with sinks,
    their gradient from this rank's rows, and with joint keys their (dk, dv) from these
    rows (accumulation dtype; the ranks' parts sum to the whole, as for any replicated
    input)."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    sinks: Tensor | None = None
    joint: tuple[Tensor, Tensor] | None = None


def startrail_rank_backward(
    dout: Tensor,
    out: Tensor,
    saved: tuple[Tensor, Tensor, Tensor],
    rc: RankCall,
    scale: float,
    kernel: AttentionKernel,
    sinks: Tensor | None = None,
    joint: tuple[Tensor, Tensor] | None = None,
) -> RankGrads:
    """One rank's backward. ``out`` is this rank's forward output and ``saved`` what
    ``startrail_rank_forward`` returned with it, on the same ``rc``."""
    q_team, kv_local, lse_team = saved
    C = rc.layout.team_size
    s, b, hq, d = dout.shape
    n, hkv = C * s, kv_local.shape[3]
    acc = acc_dtype(dout.dtype)
    softcap = rc.options.softcap
    order = rc.team_order
    # Team rows' dout and D = rowsum(dout * out), gathered in team order, while K,V
    # travels to its first holder (Note [overlap]).
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [s, b, hq]
    dout_gather = rc.team_comm.all_gather_start(dout, "dout")
    delta_gather = rc.team_comm.all_gather_start(delta, "delta")
    ring = KVRing(rc, order, rc.active_steps(s))
    ring.start_placement(kv_local)
    d_sinks = None
    if sinks is not None:  # d sink_h = -sum over this rank's rows of p_sink * D
        lse_mine = order.member_rows(lse_team.permute(2, 0, 1), s)  # [s, b, hq]
        p_sink = torch.exp(sinks.to(acc).view(1, 1, hq) - lse_mine)
        d_sinks = -(p_sink * delta).sum((0, 1))
    dout_team = delta_team = dq = None  # gathered at the first step, after its own rows'
    split = rc.splits_first_step(hq, hkv)
    dkv_pending = dkv_sent = None  # dkv_sent: the buffer reused across steps
    # The last step runs head group by head group (``tail_head_groups``): a group's dq is
    # complete once its calls are done, and its reduce-scatter runs while the next group
    # computes (Note [overlap]).
    tail, dq_scatters = tail_head_groups(rc.layout, hq, hkv, bool(rc.options.dropout_p)), []
    last = len(ring.steps) - 1
    for i, step, kv in ring.held(kv_local):  # kv: [n, 2, b, hkv, d], team order
        if dq is None:  # after the placement's member-order buffer is freed
            dq = torch.zeros(n, b, hq, d, dtype=acc, device=dout.device)
        dkv = StepDkvSum(dkv_pending, dq, (n, 2, b, hkv, d))  # the sum received, or zeros
        plan = rc.plan(step, s, kernel, own_first=split and dout_team is None)
        if dout_team is None:  # the first step's calls on this rank's own rows, then the rest
            for own in plan.own:  # local rows: while the team's dout and delta arrive
                c, ql = own.call, own.local_q_rows
                row_backward(
                    kernel, dout[ql], q_team[c.q_rows], kv[c.kv_rows], delta[ql],
                    lse_team[..., c.q_rows], dq[c.q_rows], dkv.row_adder(kv_rows=c.kv_rows),
                    c.causal, scale, kernel_options(softcap, None, c),
                )  # fmt: skip
            dout_team = order.to_team(dout_gather.wait(), in_place=True)
            delta_team = order.to_team(delta_gather.wait(), in_place=True)
            del delta
        for g, (qh, kh) in enumerate(tail if i == last else ALL_HEADS):
            do_g, q_g, dl_g = dout_team[:, :, qh], q_team[:, :, qh], delta_team[:, :, qh]
            dq_g, kv_g, lse_g = dq[:, :, qh], kv[:, :, :, kh], lse_team[:, qh]
            for j, call in enumerate(plan.varlen):
                varlen_backward(
                    kernel, call, do_g, q_g, kv_g, dl_g, lse_g, dq_g, dkv.adder(kh), scale,
                    kernel_options(softcap, rc.dropouts.at(step, j)),
                )  # fmt: skip
            for j, c in enumerate(plan.rows):
                row_backward(
                    kernel, do_g[c.q_rows], q_g[c.q_rows], kv_g[c.kv_rows], dl_g[c.q_rows],
                    lse_g[..., c.q_rows], dq_g[c.q_rows], dkv.row_adder(kh, c.kv_rows),
                    c.causal, scale, kernel_options(softcap, rc.dropouts.at(step, j), c),
                )  # fmt: skip
            if i == last and g < len(tail) - 1:  # these heads' dq is complete: reduce-
                part = order.from_team(dq_g, in_place=True).reshape(C, -1)  # scatter it
                dq_scatters.append(rc.team_comm.reduce_scatter_start(part, "dq"))  # meanwhile
            # views keep their bases alive: none may outlive the step's buffers
            del do_g, q_g, dl_g, dq_g, kv_g, lse_g
        # This step's sum goes on; the buffer sent last step (its send done with the
        # receive just waited on) receives the next one.
        total = dkv.total()
        dkv_pending = ring.pass_on(total, i, "dkv", dkv_sent)
        dkv_sent = total
        del dkv, total
    del kv, delta_team, dout_team
    # The held copy's dK/dV goes home, each member its own rows (the buffers of the steps
    # freed first); dq's reduce-scatters run while the parts travel, and the joint keys'
    # part (local rows) is computed meanwhile.
    dkv_home = ring.send_dkv_home(dkv_sent)
    del dkv_sent
    part = order.from_team(dq[:, :, tail[-1][0]], in_place=True).reshape(C, -1)  # last group
    dq_scatters.append(rc.team_comm.reduce_scatter_start(part, "dq"))
    del dq, part
    gq_joint = d_joint = None
    if joint is not None:
        gq_joint, d_joint = joint_backward(
            rc, order, dout, out, q_team, lse_team, joint, scale, kernel, acc
        )
    # This rank's rows of each of its team's C K,V copies' dK/dV, summed in copy order.
    parts = dkv_home.wait()
    g_kv = parts[0] if C == 1 else parts[0] + parts[1]
    for part in parts[2:]:
        g_kv += part
    del parts
    dq_parts = [h.wait().view(s, b, -1, d) for h in dq_scatters]
    g_q = dq_parts[0] if len(dq_parts) == 1 else torch.cat(dq_parts, dim=2)
    del dq_parts
    if gq_joint is not None:
        g_q = g_q + gq_joint
    dt = dout.dtype
    return RankGrads(g_q.to(dt), g_kv[:, 0].to(dt), g_kv[:, 1].to(dt), d_sinks, d_joint)
