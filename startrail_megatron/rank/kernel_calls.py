"""One kernel call of the schedule, in each direction: a ``RowCall`` on slices of the team
buffers, or a ``VarlenCall`` on THD gathers of them, folded into the running results
(the forward's (out, lse) by ``merge_partial``; the backward's dq in place and dK/dV
through the step's ``StepDkvSum``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels import AttentionKernel, Dropout, merge_partial
from ..schedule import RowCall, VarlenCall
from .thd import from_thd, to_thd, varlen_index

__all__ = [
    "delta_stand_in",
    "kernel_options",
    "row_backward",
    "row_forward",
    "varlen_backward",
    "varlen_forward",
]


def kernel_options(softcap: float, drop: Dropout | None, call: RowCall | None = None) -> dict:
    """The kernel keywords of a call: ``band`` for a window call, ``softcap`` and
    ``dropout`` only where set (kernels without them keep their signature)."""
    out: dict = {} if call is None or call.band is None else {"band": call.band}
    if softcap:
        out["softcap"] = softcap
    if drop is not None:
        out["dropout"] = drop
    return out


def row_forward(
    kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, out_rows: Tensor,
    lse_rows: Tensor, causal: bool, scale: float, options: dict,
) -> None:  # fmt: skip
    """One row call of the forward, merged into the accumulators' rows (views)."""
    o, lse = kernel.forward(q, k, v, causal=causal, scale=scale, **options)
    merge_partial(out_rows, lse_rows, o, lse)


def delta_stand_in(dout: Tensor, delta: Tensor) -> Tensor:
    """A stand-in for ``out`` with the same row statistic ``rowsum(dout * out) = delta``.

    Kernels take the backward's D from (dout, out); only D matters, so the team rows need
    not gather the real output, and each call makes the stand-in of its own rows only (a
    team-sized one would be held through the whole backward).
    ``dout/|dout| * (delta/|dout|)``: by Cauchy-Schwarz its size is at most |out|, and a
    zero ``dout`` row gives 0. ``delta``: ``dout``'s shape without the last dimension.
    """
    acc = delta.dtype
    do = dout.to(acc)
    nrm = torch.linalg.vector_norm(do, dim=-1)  # [n, b, h]
    ok = nrm > 0
    safe = torch.where(ok, nrm, torch.ones_like(nrm))
    scale = torch.where(ok, delta / safe, torch.zeros_like(delta)) / safe
    return (do * scale.unsqueeze(-1)).to(dout.dtype)


def row_backward(
    kernel: AttentionKernel, dout: Tensor, q: Tensor, kv: Tensor, delta: Tensor,
    lse: Tensor, dq_rows: Tensor, add_dkv: Callable[[Tensor, Tensor], None], causal: bool,
    scale: float, options: dict,
) -> None:  # fmt: skip
    """One row call of the backward (``kv``: the call's K,V rows ``[t, 2, ...]``;
    ``delta``: the rows' ``rowsum(dout * out)``, from which the call's output stand-in is
    made): dq's gradient added into ``dq_rows`` (a view), dK/dV's through ``add_dkv``
    (``StepDkvSum.row_adder``: at once, or once the step's sum has arrived)."""
    out = delta_stand_in(dout, delta)
    g_q, g_k, g_v = kernel.backward(
        dout, q, kv[:, 0], kv[:, 1], out, lse, causal=causal, scale=scale, **options
    )
    del out
    dq_rows += g_q
    add_dkv(g_k, g_v)


def varlen_forward(
    kernel, call: VarlenCall, q_team: Tensor, kv: Tensor, acc_out: Tensor, acc_lse: Tensor,
    scale: float, options: dict,
) -> None:  # fmt: skip
    """One ``VarlenCall`` of the forward: gather its rows, one kernel call, fold the
    result into the running (acc_out, acc_lse) of those rows."""
    b = q_team.shape[1]
    ix = varlen_index(call, b, q_team.device)
    o, lse = kernel.forward_varlen(
        to_thd(q_team, ix.q_rows), to_thd(kv[:, 0], ix.kv_rows), to_thd(kv[:, 1], ix.kv_rows),
        ix.cu_q, ix.cu_k, ix.max_q, ix.max_k, causal=ix.causal, scale=scale, **options,
    )  # fmt: skip
    hq = q_team.shape[2]
    part_out = acc_out.index_select(0, ix.q_rows)
    part_lse = acc_lse.index_select(2, ix.q_rows)
    merge_partial(part_out, part_lse, from_thd(o, b), lse.view(hq, b, -1).transpose(0, 1))
    acc_out.index_copy_(0, ix.q_rows, part_out)
    acc_lse.index_copy_(2, ix.q_rows, part_lse)


def varlen_backward(
    kernel, call: VarlenCall, dout_team: Tensor, q_team: Tensor, kv: Tensor,
    delta_team: Tensor, lse_team: Tensor, dq: Tensor, add_dkv: Callable, scale: float,
    options: dict,
) -> None:  # fmt: skip
    """One ``VarlenCall`` of the backward (``delta_team``: the rows' ``rowsum(dout *
    out)``, ``[n, b, hq]``): gradients added into dq's rows and, through ``add_dkv``
    (``StepDkvSum.adder`` on this head group), into the step's dK/dV."""
    b, hq = q_team.shape[1], q_team.shape[2]
    ix = varlen_index(call, b, q_team.device)
    lse = lse_team.index_select(2, ix.q_rows).transpose(0, 1).reshape(hq, -1)  # [hq, b*t]
    dout = to_thd(dout_team, ix.q_rows)
    out = delta_stand_in(dout, to_thd(delta_team, ix.q_rows))
    g_q, g_k, g_v = kernel.backward_varlen(
        dout, to_thd(q_team, ix.q_rows), to_thd(kv[:, 0], ix.kv_rows),
        to_thd(kv[:, 1], ix.kv_rows), out, lse,
        ix.cu_q, ix.cu_k, ix.max_q, ix.max_k, causal=ix.causal, scale=scale, **options,
    )  # fmt: skip
    del dout, out
    acc = dq.dtype
    dq.index_add_(0, ix.q_rows, from_thd(g_q, b).to(acc))
    del g_q
    rows = ix.kv_rows

    def add(t: Tensor) -> None:
        t[:, 0].index_add_(0, rows, from_thd(g_k, b).to(acc))
        t[:, 1].index_add_(0, rows, from_thd(g_v, b).to(acc))

    add_dkv(add)
