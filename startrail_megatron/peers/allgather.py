"""StarTrail's peers as attention functions with the same contract, for benchmarks.

Same call shape as ``startrail_attention``: q ``[s_local, b, heads_q, head_dim]``,
k/v ``[s_local, b, heads_kv, head_dim]`` (Megatron layout; causal expects the
zigzag split), an explicit process group, ``ledger=CommLedger`` accounting.

``allgather_attention`` (Megatron's ``cp_comm_type="all_gather"``, i.e.
TransformerEngine's ``AttnFuncWithCPAndKVAllGather``): all-gather K and V over
the whole CP group, compute the local queries against the keys they need
(``block_plan.allgather_calls``: every rank computes the same number of
(q, k) pairs), and in the backward all-gather K, V again and reduce-scatter
dK, dV.

``ulysses_attention`` (DeepSpeed-Ulysses): DeepSpeed's own
``deepspeed.sequence.layer.DistributedAttention`` around our local kernel.
Its all-to-alls turn the sequence shard into a head shard (every rank: the
whole sequence, heads/P heads), the local kernel runs full causal attention
(the zigzag-ordered gathered sequence is put in natural order first), and the
output goes back by the inverse all-to-all. Needs ``heads_q`` and
``heads_kv`` divisible by P. DeepSpeed is imported lazily, only here.

Ring attention is ``startrail_attention`` with ``team_size=1``.

Communication per rank and call: the table and the functions
(``allgather_comm_bytes``, ``ulysses_comm_bytes``, their ``*_comm_calls``) are in
``accounting.py``, pure arithmetic; the tests check them against the ledger, and
the planner uses them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..accounting import ulysses_supported
from ..attention import validate_inputs
from ..block_plan import allgather_calls
from ..comm import CommLedger, TeamComm, tap_all_to_all
from ..kernels import AttentionKernel, acc_dtype, merge_partial, resolve_kernel
from ..zigzag import inverse_order, reorder_chunks

__all__ = ["allgather_attention", "ulysses_attention"]


# ---- shared pieces ----------------------------------------------------------
def _cp(cp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("this attention needs torch.distributed to be initialized")
    return dist.get_rank(cp_group), dist.get_world_size(cp_group)


def _natural_order(p: int) -> list[int]:
    """Chunk positions of the rank-ordered gathered buffer, in global chunk order.

    The gathered buffer holds ``[c0, c(2P-1), c1, c(2P-2), ...]``; chunk ``j`` sits
    at position ``2j`` for ``j < P`` and at ``2(2P-1-j) + 1`` otherwise.
    """
    return [2 * j if j < p else 2 * (2 * p - 1 - j) + 1 for j in range(2 * p)]


# ---- all-gather KV ----------------------------------------------------------
class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_group, causal, scale, kernel, ledger):
        rank, p = _cp(cp_group)
        if ledger is not None:
            ledger.phase = "fwd"
        comm = TeamComm(cp_group, p, ledger)
        kv = comm.all_gather(torch.stack((k, v), dim=1), "kv")  # [P*s, 2, b, hkv, d] rank order
        if causal:
            kv = reorder_chunks(kv, _natural_order(p))  # natural chunk order
        s, b, hq, d = q.shape
        acc = acc_dtype(q.dtype)
        out = torch.zeros(s, b, hq, d, dtype=acc, device=q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
        for qs, ks, cz in allgather_calls(rank, p, causal, s):
            o, l_ = kernel.forward(q[qs], kv[ks, 0], kv[ks, 1], causal=cz, scale=scale)
            merge_partial(out[qs], lse[..., qs], o, l_)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (cp_group, causal, scale, kernel, ledger, rank, p)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp_group, causal, scale, kernel, ledger, rank, p = ctx.cfg
        if ledger is not None:
            ledger.phase = "bwd"
        comm = TeamComm(cp_group, p, ledger)
        dout = dout.contiguous()
        kv = comm.all_gather(torch.stack((k, v), dim=1), "kv")  # gathered again, as TE does
        order = _natural_order(p) if causal else list(range(2 * p))
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
        return dq.to(dt), dkv[:, 0].to(dt), dkv[:, 1].to(dt), None, None, None, None, None


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
) -> Tensor:
    """Exact attention with K and V all-gathered over the CP group (Megatron's ``all_gather``).

    Args: as ``startrail_attention``, with the CP group (``None`` = world)
    instead of StarTrail's groups. Returns out ``[s_local, b, heads_q, head_dim]``.
    """
    _, p = _cp(cp_group)
    validate_inputs(q, k, v, p, causal)
    kern, scale = resolve_kernel(q, kernel, softmax_scale)
    return _AllGatherAttention.apply(q, k, v, cp_group, bool(causal), scale, kern, ledger)


# ---- Ulysses ----------------------------------------------------------------
class _LocalAttention(torch.autograd.Function):
    """One kernel call with autograd: the kernel contract's forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (causal, scale, kernel)
        return out

    @staticmethod
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
        order = _natural_order(self.p)
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
) -> Tensor:
    """DeepSpeed-Ulysses: ``DistributedAttention`` (DeepSpeed's) around our local kernel.

    Args: as ``allgather_attention``. ``heads_q`` and ``heads_kv`` must be
    multiples of the CP size (``ValueError`` otherwise, before any
    communication). The all-to-alls are DeepSpeed's; ``ledger`` records them
    through ``comm.tap_all_to_all``.
    """
    _, p = _cp(cp_group)
    validate_inputs(q, k, v, p, causal)
    hq, hkv = q.shape[2], k.shape[2]
    if not ulysses_supported(p, hq, hkv):
        raise ValueError(
            f"Ulysses shards heads over the CP group: heads_q ({hq}) and heads_kv ({hkv}) must "
            f"be multiples of the CP size {p}"
        )
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
        tap_all_to_all(x, ledger, p, w, "d" + w) for x, w in ((q, "q"), (k, "k"), (v, "v"))
    )
    out = attn(qt, kt, vt, 1)  # batch_dim_idx=1: [s, b, h, d]
    return tap_all_to_all(out, ledger, p, "out", "dout")
