"""Joint keys (MMDiT text tokens, the same on every CP rank) on this rank's own rows.

Every (real) query sees the joint keys once: each rank folds them into its own rows of
the team accumulators in the forward, and takes their gradient from its own rows in the
backward (the ranks' parts sum to the whole, as for any replicated input).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import AttentionKernel, merge_partial
from .call import RankCall
from .kernel_calls import kernel_options
from .team_order import TeamOrder, real_rows

__all__ = ["joint_backward", "joint_forward"]


def joint_forward(
    rc: RankCall, order: TeamOrder, q: Tensor, joint: tuple[Tensor, Tensor], acc_out: Tensor,
    acc_lse: Tensor, scale: float, kernel: AttentionKernel,
) -> None:  # fmt: skip
    """Fold the joint keys into this member's own rows of the team accumulators
    (``TeamCombine.out`` / ``.lse``)."""
    s = q.shape[0]
    real = real_rows(rc.packed, rc.rank, q.device)
    rows = torch.arange(s, device=q.device) if real is None else real
    if rows.numel() == 0:
        return
    qr = q if real is None else q.index_select(0, real)
    o, lse = kernel.forward(
        qr, joint[0], joint[1], causal=False, scale=scale,
        **kernel_options(rc.options.softcap, None),
    )  # fmt: skip
    team_pos = order.team_positions(rows, acc_out.shape[0])
    sub_o, sub_l = acc_out.index_select(0, team_pos), acc_lse.index_select(2, team_pos)
    merge_partial(sub_o, sub_l, o, lse)
    acc_out.index_copy_(0, team_pos, sub_o)
    acc_lse.index_copy_(2, team_pos, sub_l)


def joint_backward(
    rc: RankCall, order: TeamOrder, dout: Tensor, out: Tensor, q_team: Tensor,
    lse_team: Tensor, joint: tuple[Tensor, Tensor], scale: float, kernel: AttentionKernel,
    acc: torch.dtype,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:  # fmt: skip
    """The joint keys' part of this rank's rows: (their dq on the local rows, in ``acc``;
    the joint keys' (dk, dv) from these rows)."""
    s = dout.shape[0]
    jk, jv = joint
    g_q = torch.zeros(dout.shape, dtype=acc, device=dout.device)
    real = real_rows(rc.packed, rc.rank, dout.device)
    if real is not None and real.numel() == 0:
        zeros = (
            torch.zeros(jk.shape, dtype=acc, device=jk.device),
            torch.zeros(jv.shape, dtype=acc, device=jv.device),
        )
        return g_q, zeros
    q_loc = order.member_rows(q_team, s)
    lse_loc = order.member_rows(lse_team.permute(2, 0, 1), s)  # [s, b, hq]
    pick = (lambda x: x) if real is None else (lambda x: x.index_select(0, real))
    gq, gk, gv = kernel.backward(
        pick(dout), pick(q_loc), jk, jv, pick(out), pick(lse_loc).permute(1, 2, 0).contiguous(),
        causal=False, scale=scale, **kernel_options(rc.options.softcap, None),
    )  # fmt: skip
    if real is None:
        g_q += gq.to(acc)
    else:
        g_q.index_add_(0, real, gq.to(acc))
    return g_q, (gk.to(acc), gv.to(acc))
