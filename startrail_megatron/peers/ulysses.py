"""DeepSpeed-Ulysses: DeepSpeed's own ``DistributedAttention`` around our local kernel.

``deepspeed.sequence.layer.DistributedAttention``'s all-to-alls turn the
sequence shard into a head shard (every rank: the whole sequence, heads/P
heads), the local kernel runs full causal attention (the zigzag-ordered
gathered sequence is put in natural order first), and the output goes back by
the inverse all-to-all. Needs ``heads_q`` and ``heads_kv`` divisible by P.
DeepSpeed is imported lazily, only here. Bytes and calls:
``accounting.ulysses_comm_bytes`` / ``ulysses_comm_calls``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..accounting import ulysses_supported
from ..comm import CommLedger, CommOptions, tap_all_to_all
from ..kernels import AttentionKernel, resolve_kernel
from ..validation import check_comm_options, first_order_only, validate_inputs
from ..zigzag import inverse_order, reorder_chunks
from .common import cp_rank_and_size, natural_order

__all__ = ["ulysses_attention"]


class _LocalAttention(torch.autograd.Function):
    """One kernel call with autograd: the kernel contract's forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (causal, scale, kernel)
        return out

    @staticmethod
    @first_order_only("ulysses_attention")
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, kernel = ctx.cfg
        dq, dk, dv = kernel.backward(
            dout.contiguous(), q, k, v, out, lse, causal=causal, scale=scale
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _UlyssesLocal:
    """The local attention DeepSpeed's DistributedAttention calls: full sequence, heads/P."""

    def __init__(self, p: int, causal: bool, scale: float, kernel: AttentionKernel):
        self.p, self.causal, self.scale, self.kernel = p, causal, scale, kernel

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [N, b, h/P, d] each
        if not self.causal:
            return _LocalAttention.apply(q, k, v, False, self.scale, self.kernel)
        order = natural_order(self.p)
        q, k, v = (reorder_chunks(x, order) for x in (q, k, v))  # zigzag -> natural order
        out = _LocalAttention.apply(q, k, v, True, self.scale, self.kernel)
        return reorder_chunks(out, inverse_order(order))


def _deepspeed_comm_ready() -> None:
    try:
        import deepspeed.comm as dscomm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ulysses_attention needs DeepSpeed: pip install 'startrail_megatron[deepspeed]'"
        ) from e
    if not dscomm.is_initialized():
        # Wraps the already initialized torch.distributed world; no new rendezvous.
        dscomm.init_distributed(
            dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False
        )


def ulysses_attention(
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
    """DeepSpeed-Ulysses: ``DistributedAttention`` (DeepSpeed's) around our local kernel.

    Args: as ``allgather_attention``. ``heads_q`` and ``heads_kv`` must be
    multiples of the CP size (``ValueError`` otherwise, before any
    communication). The all-to-alls are DeepSpeed's (blocking); ``ledger`` records
    them through ``comm.tap_all_to_all``, which also adds ``comm_options``' delay
    beside each one (exposed: nothing overlaps them).
    """
    _, p = cp_rank_and_size(cp_group)
    validate_inputs(q, k, v, p, causal)
    hq, hkv = q.shape[2], k.shape[2]
    if not ulysses_supported(p, hq, hkv):
        raise ValueError(
            f"Ulysses shards heads over the CP group: heads_q ({hq}) and heads_kv ({hkv}) must "
            f"be multiples of the CP size {p}"
        )
    options = check_comm_options(comm_options, q)
    kern, scale = resolve_kernel(q, kernel, softmax_scale)
    _deepspeed_comm_ready()
    from deepspeed.sequence.layer import DistributedAttention

    group = cp_group if cp_group is not None else dist.group.WORLD
    attn = DistributedAttention(
        _UlyssesLocal(p, bool(causal), scale, kern), group, scatter_idx=2, gather_idx=0
    )
    if ledger is not None:
        ledger.phase = "fwd"
    qt, kt, vt = (
        tap_all_to_all(x, ledger, p, w, "d" + w, options, group)
        for x, w in ((q, "q"), (k, "k"), (v, "v"))
    )
    out = attn(qt, kt, vt, 1)  # batch_dim_idx=1: [s, b, h, d]
    return tap_all_to_all(out, ledger, p, "out", "dout", options, group)
