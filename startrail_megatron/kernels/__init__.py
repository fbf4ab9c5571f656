"""Local attention kernels behind one contract, and the one merge function.

Contract (seq-first, Megatron's layout):

  forward(q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, d], *, causal, scale)
      -> out [sq, b, hq, d] (q's dtype), lse [b, hq, sq] (fp32; fp64 for fp64)
  backward(dout, q, k, v, out, lse, *, causal, scale) -> dq, dk, dv

``causal`` is the top-left causal mask of a diagonal block (sq == sk).
``hq`` must be a multiple of ``hkv`` (GQA/MQA); KV heads are broadcast, never
repeated in memory by the reference kernel. In the backward, ``out`` and
``lse`` are the *final* (merged) output and log-sum-exp of the rows, so that
a partial block's gradients are exact (``D = rowsum(dout * out)``).

Kernels here: ``"torch"`` (pure PyTorch, any device and dtype, float64-capable:
the reference) and ``"sdpa"`` (PyTorch's fused SDPA ops that return the
log-sum-exp: the CPU flash kernel; on CUDA the efficient-attention kernel).
The GPU backends (flash-attn 2, PyTorch's CUDA flash / cuDNN / efficient ops,
Transformer Engine's fused attention) live in ``backends.py``. ``get_kernel("auto")`` picks the fastest available
for the inputs; ``$STARTRAIL_KERNEL`` overrides ``"auto"``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "AttentionKernel",
    "KERNELS",
    "TorchKernel",
    "SdpaKernel",
    "get_kernel",
    "resolve_kernel",
    "merge_partial",
    "acc_dtype",
]


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


def _finite_lse(lse: Tensor) -> Tensor:
    """lse with -inf (rows that see no key) replaced by +inf so exp(s - lse) = 0."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


class TorchKernel:
    """Pure-PyTorch attention in the accumulation dtype: the reference kernel."""

    name = "torch"

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
        sq, b, hq, d = q.shape
        sk, _, hkv, _ = k.shape
        g = hq // hkv
        dt = acc_dtype(q.dtype)
        qg = q.to(dt).permute(1, 2, 0, 3).reshape(b, hkv, g, sq, d)  # (b, hkv, g, sq, d)
        kg = k.to(dt).permute(1, 2, 0, 3).unsqueeze(2)  # (b, hkv, 1, sk, d)
        s = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # (b, hkv, g, sq, sk)
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(mask, -math.inf)
        return s

    def forward(self, q, k, v, *, causal, scale):
        sq, b, hq, d = q.shape
        s = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # (b, hkv, g, sq)
        p = torch.exp(s - _finite_lse(lse).unsqueeze(-1))
        vg = v.to(s.dtype).permute(1, 2, 0, 3).unsqueeze(2)  # (b, hkv, 1, sk, d)
        out = torch.matmul(p, vg)  # (b, hkv, g, sq, d)
        out = out.reshape(b, hq, sq, d).permute(2, 0, 1, 3).to(q.dtype)
        return out, lse.reshape(b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        sq, b, hq, d = q.shape
        sk, _, hkv, _ = k.shape
        g = hq // hkv
        s = self._scores(q, k, causal, scale)
        dt = s.dtype
        lse_g = _finite_lse(lse.to(dt)).reshape(b, hkv, g, sq, 1)
        p = torch.exp(s - lse_g)  # (b, hkv, g, sq, sk)

        def heads(x: Tensor, h: int) -> Tensor:  # [s, b, h, d] -> (b, hkv, h/hkv, s, d)
            return x.to(dt).permute(1, 2, 0, 3).reshape(b, hkv, h // hkv, x.shape[0], d)

        do, o = heads(dout, hq), heads(out, hq)
        kg, vg, qg = heads(k, hkv), heads(v, hkv), heads(q, hq)
        delta = (do * o).sum(-1, keepdim=True)  # (b, hkv, g, sq, 1)
        dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # (b, hkv, sk, d)
        dp = torch.matmul(do, vg.transpose(-1, -2))  # (b, hkv, g, sq, sk)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, kg)  # (b, hkv, g, sq, d)
        dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2)  # (b, hkv, sk, d)
        dq = dq.reshape(b, hq, sq, d).permute(2, 0, 1, 3)
        return dq, dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)


class SdpaKernel:
    """PyTorch's fused SDPA kernels that return the log-sum-exp.

    CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward),
    any float dtype, GQA natively. CUDA: ``aten._scaled_dot_product_efficient_
    attention`` (+ backward), fp32/fp16/bf16; KV heads are expanded (a view
    where possible) since that kernel has no GQA.
    """

    name = "sdpa"

    @staticmethod
    def _bhsd(x: Tensor) -> Tensor:
        return x.permute(1, 2, 0, 3)  # [s, b, h, d] -> (b, h, s, d)

    def forward(self, q, k, v, *, causal, scale):
        if q.device.type != "cpu":
            return self._cuda().forward(q, k, v, causal=causal, scale=scale)
        qb, kb, vb = self._bhsd(q), self._bhsd(k), self._bhsd(v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, causal, scale=scale
        )
        return out.permute(2, 0, 1, 3), lse.to(acc_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        if q.device.type != "cpu":
            return self._cuda().backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        qb, kb, vb = self._bhsd(q), self._bhsd(k), self._bhsd(v)
        dob, ob = self._bhsd(dout.to(q.dtype)), self._bhsd(out.to(q.dtype))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dob,
            qb,
            kb,
            vb,
            ob,
            lse.to(acc_dtype(q.dtype)).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)

    @staticmethod
    def _cuda() -> AttentionKernel:
        from .backends import SdpaEfficientKernel  # lazy: backends imports this module

        return SdpaEfficientKernel()


KERNELS: dict[str, type] = {"torch": TorchKernel, "sdpa": SdpaKernel}
"""The kernels of this module; ``backends.KERNEL_NAMES`` lists every name."""


def get_kernel(
    name: str = "auto",
    dtype: torch.dtype | None = None,
    *,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
) -> AttentionKernel:
    """A kernel by name, or the fastest one that runs these inputs.

    Args:
        name: ``"auto"`` or one of ``backends.KERNEL_NAMES`` (``"torch"``,
            ``"sdpa"``, ``"flash_attn"``, ``"sdpa_flash"``, ``"sdpa_cudnn"``,
            ``"sdpa_efficient"``, ``"te"``; ``"te"`` only by name, never by ``"auto"``).
            ``"auto"`` is replaced by ``$STARTRAIL_KERNEL`` when that is set.
        dtype, device, head_dim: the inputs' (device defaults to CPU); ``"auto"``
            picks by them (float64 always gets the exact ``"torch"`` kernel),
            an explicit name raises ``NotImplementedError`` if it cannot run them.

    Raises:
        ValueError: an unknown name (naming the setting and the allowed values).
    """
    from .backends import build_kernel  # lazy: backends imports this module

    return build_kernel(name, dtype, device=device, head_dim=head_dim)


def resolve_kernel(
    q: Tensor, kernel: str | AttentionKernel, softmax_scale: float | None
) -> tuple[AttentionKernel, float]:
    """The kernel object and softmax scale an attention call on ``q`` uses.

    A name is looked up with ``get_kernel`` for q's dtype, device and head_dim;
    the scale defaults to ``head_dim ** -0.5``.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if isinstance(kernel, str):
        kernel = get_kernel(kernel, q.dtype, device=q.device, head_dim=q.shape[-1])
    return kernel, scale


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
