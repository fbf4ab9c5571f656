"""All-gather-KV attention: Megatron's ``cp_comm_type="all_gather"``.

As TransformerEngine's ``AttnFuncWithCPAndKVAllGather``: all-gather K and V
over the whole CP group, compute the local queries against the keys they need
(``schedule.allgather_calls``: every rank computes the same number of
(q, k) pairs), and in the backward all-gather K, V again and reduce-scatter
dK, dV. Bytes and calls: ``accounting.allgather_comm_bytes`` /
``allgather_comm_calls``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import CommLedger, CommOptions, TeamComm
from ..kernels import AttentionKernel, acc_dtype, merge_partial, resolve_kernel
from ..schedule import allgather_calls
from ..validation import check_comm_options, first_order_only, validate_inputs
from ..zigzag import inverse_order, reorder_chunks
from .common import cp_rank_and_size, natural_order

__all__ = ["allgather_attention"]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_group, causal, scale, kernel, ledger, options):
        rank, p = cp_rank_and_size(cp_group)
        if ledger is not None:
            ledger.phase = "fwd"
        comm = TeamComm(cp_group, p, ledger, options)
        kv = comm.all_gather(torch.stack((k, v), dim=1), "kv")  # [P*s, 2, b, hkv, d] rank order
        if causal:
            kv = reorder_chunks(kv, natural_order(p))  # natural chunk order
        s, b, hq, d = q.shape
        acc = acc_dtype(q.dtype)
        out = torch.zeros(s, b, hq, d, dtype=acc, device=q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
        for qs, ks, cz in allgather_calls(rank, p, causal, s):
            o, l_ = kernel.forward(q[qs], kv[ks, 0], kv[ks, 1], causal=cz, scale=scale)
            merge_partial(out[qs], lse[..., qs], o, l_)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (cp_group, causal, scale, kernel, ledger, rank, p, options)
        return out

    @staticmethod
    @first_order_only("allgather_attention")
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp_group, causal, scale, kernel, ledger, rank, p, options = ctx.cfg
        if ledger is not None:
            ledger.phase = "bwd"
        comm = TeamComm(cp_group, p, ledger, options)
        dout = dout.contiguous()
        kv = comm.all_gather(torch.stack((k, v), dim=1), "kv")  # gathered again, as TE does
        order = natural_order(p) if causal else list(range(2 * p))
        if causal:
            kv = reorder_chunks(kv, order)
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # [P*s, 2, b, hkv, d]
        for qs, ks, cz in allgather_calls(rank, p, causal, q.shape[0]):
            g_q, g_k, g_v = kernel.backward(
                dout[qs],
                q[qs],
                kv[ks, 0],
                kv[ks, 1],
                out[qs],
                lse[..., qs],
                causal=cz,
                scale=scale,
            )
            dq[qs] += g_q
            dkv[ks, 0] += g_k
            dkv[ks, 1] += g_v
        if causal:
            dkv = reorder_chunks(dkv, inverse_order(order))  # back to rank order
        dkv = comm.reduce_scatter(dkv, "dkv")  # [s, 2, b, hkv, d]
        dt = q.dtype
        return dq.to(dt), dkv[:, 0].to(dt), dkv[:, 1].to(dt), None, None, None, None, None, None


def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_group: dist.ProcessGroup | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
    ledger: CommLedger | None = None,
    comm_options: CommOptions | None = None,
) -> Tensor:
    """Exact attention with K and V all-gathered over the CP group (Megatron's ``all_gather``).

    Args: as ``startrail_attention``, with the CP group (``None`` = world)
    instead of StarTrail's groups. Returns out ``[s_local, b, heads_q, head_dim]``.
    Its collectives are blocking (as TE's): ``comm_options``' delay is always exposed.
    """
    _, p = cp_rank_and_size(cp_group)
    validate_inputs(q, k, v, p, causal)
    options = check_comm_options(comm_options, q)
    kern, scale = resolve_kernel(q, kernel, softmax_scale)
    return _AllGatherAttention.apply(q, k, v, cp_group, bool(causal), scale, kern, ledger, options)
