"""The contract every local attention kernel implements, and the one merge function.

Contract (seq-first, Megatron's layout):

  forward(q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, d], *, causal, scale)
      -> out [sq, b, hq, d] (q's dtype), lse [b, hq, sq] (fp32; fp64 for fp64)
  backward(dout, q, k, v, out, lse, *, causal, scale) -> dq, dk, dv

``causal`` is the top-left causal mask of a diagonal block (sq == sk).
``hq`` must be a multiple of ``hkv`` (GQA/MQA); KV heads are broadcast, never
repeated in memory by the reference kernel. In the backward, ``out`` and
``lse`` are the *final* (merged) output and log-sum-exp of the rows, so that
a partial block's gradients are exact (``D = rowsum(dout * out)``).

``acc_dtype`` is the accumulation dtype of the lse and of merged outputs;
``merge_partial`` folds one kernel call's (out, lse) into a running result;
``lse_to_bhs`` brings a fused kernel's log-sum-exp to the contract's shape.

Variable-length (packed documents), optional (``VarlenAttentionKernel``): kernels
that take many sequences in one call (flash-attn's varlen functions, TE's THD
format) also implement, on THD tensors (tokens of all sequences one after another)

  forward_varlen(q [tq, hq, d], k [tk, hkv, d], v, cu_q, cu_k, max_q, max_k, *,
                 causal, scale) -> out [tq, hq, d], lse [hq, tq] (fp32)
  backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal,
                  scale) -> dq, dk, dv

Attention dropout (optional, ``supports_dropout = True``): ``forward``/``backward``
(and the varlen pair) take ``dropout=``, a ``Dropout`` record per kernel call: the
forward drops attention probabilities with probability ``p`` (the softmax
statistics, the returned lse, are those before dropout, as flash-attn's) and stores
in the record the RNG state it drew from; the backward gets the same record and
rebuilds the same mask from that state (never a stored mask).

``cu_q``/``cu_k`` are int32 ``[n + 1]`` sequence offsets on q's device, causal
sequences have equal q and k lengths; sequences of length 0 never occur. Kernels
without them run packed documents as one dense call per document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "AttentionKernel",
    "Dropout",
    "VarlenAttentionKernel",
    "acc_dtype",
    "has_varlen",
    "lse_to_bhs",
    "merge_partial",
    "varlen_lse_packed",
    "varlen_lse_padded",
]


@dataclass
class Dropout:
    """Attention dropout of one kernel call.

    Attributes:
        p: the probability of dropping an attention probability (0 < p < 1); kept ones
            are scaled by ``1 / (1 - p)``.
        generator: where the reference kernel draws (``None``: the default generator of
            the inputs' device, which Megatron's RNG tracker ``fork`` swaps in).
        state: what the forward drew from (the kernel's own form: a generator state, a
            flash-attn ``rng_state``, Philox seed and offset); ``None`` before the forward.
    """

    p: float
    generator: Any = None
    state: Any = None


class AttentionKernel(Protocol):
    """What StarTrail needs from a local attention kernel."""

    name: str

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class VarlenAttentionKernel(AttentionKernel, Protocol):
    """A kernel that also runs many sequences in one call (THD tensors)."""

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
        max_k: int, *, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip

    def backward_varlen(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]: ...  # fmt: skip


def has_varlen(kernel: object) -> bool:
    """Whether ``kernel`` implements the variable-length methods (and, where it says so
    with ``varlen_available``, its library has them)."""
    return (
        callable(getattr(kernel, "forward_varlen", None))
        and callable(getattr(kernel, "backward_varlen", None))
        and bool(getattr(kernel, "varlen_available", True))
    )


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold a partial (out, lse) into the running (acc_out, acc_lse), in place.

    acc_out [s, b, h, d] and acc_lse [b, h, s] are in the accumulation dtype;
    out may be lower precision. Rows that no key has seen yet (lse = -inf)
    stay exactly zero, never NaN.
    """
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_acc = torch.exp(acc_lse - safe).permute(2, 0, 1).unsqueeze(-1)  # [s, b, h, 1]
    w_new = torch.exp(lse.to(safe.dtype) - safe).permute(2, 0, 1).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new_lse)


def lse_to_bhs(lse: Tensor, b: int, h: int, sq: int) -> Tensor:
    """A kernel's log-sum-exp as ``[b, h, sq]`` fp32.

    Accepts ``[b, h, sq]`` (flash), ``[b, h, >= sq]`` (efficient attention pads
    the rows to a multiple of 32) and ``[b, h, sq, 1]`` (cuDNN).
    """
    if lse.dim() == 4 and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    if lse.dim() != 3 or tuple(lse.shape[:2]) != (b, h) or lse.shape[2] < sq:
        raise RuntimeError(
            f"kernel returned log-sum-exp of shape {tuple(lse.shape)}; expected [{b}, {h}, "
            f">= {sq}] or [{b}, {h}, {sq}, 1]"
        )
    return lse[..., :sq].float()


def _padded_index(cu_q: Tensor, t: int, max_q: int) -> Tensor:
    """For each of the t THD rows, its place ``seq * max_q + pos`` in a per-sequence padded
    ``[n, max_q]`` layout (no host sync)."""
    n = cu_q.shape[0] - 1
    cu = cu_q.long()
    seq = torch.repeat_interleave(
        torch.arange(n, device=cu.device), cu[1:] - cu[:-1], output_size=t
    )
    return seq * max_q + torch.arange(t, device=cu.device) - cu[seq]


def varlen_lse_packed(lse: Tensor, cu_q: Tensor, t: int) -> Tensor:
    """A per-sequence padded log-sum-exp ``[n, h, max_q]`` -> ``[h, t]`` (THD rows)."""
    n, h, max_q = lse.shape
    idx = _padded_index(cu_q, t, max_q)
    return lse.transpose(0, 1).reshape(h, n * max_q).index_select(1, idx)


def varlen_lse_padded(lse: Tensor, cu_q: Tensor, max_q: int) -> Tensor:
    """``[h, t]`` -> the per-sequence padded ``[n, h, max_q]`` (padding rows 0)."""
    h, t = lse.shape
    n = cu_q.shape[0] - 1
    out = lse.new_zeros(h, n * max_q)
    out.index_copy_(1, _padded_index(cu_q, t, max_q), lse)
    return out.view(h, n, max_q).transpose(0, 1).contiguous()
