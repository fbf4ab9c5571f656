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
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["AttentionKernel", "acc_dtype", "lse_to_bhs", "merge_partial"]


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
