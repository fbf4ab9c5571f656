"""The one float64 reference and the input helpers shared by tests, demo, benchmark and GPU check.

``reference_attention`` is dense softmax attention over the whole sequence in
float64, forward and backward through autograd, one KV head group at a time
(memory bounded by one group's ``[b, g, n, n]`` scores). Everything that
claims StarTrail (or a peer) is exact compares against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .zigzag import zigzag_shard, zigzag_unshard

__all__ = ["make_inputs", "reference_attention", "rel_err", "shard", "unshard"]


def make_inputs(
    seed: int,
    n: int,
    b: int,
    hq: int,
    hkv: int,
    d: int,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Full-sequence q ``[n, b, hq, d]``, k, v ``[n, b, hkv, d]``, dout like q, from one seed.

    Drawn on the CPU (the same values on every rank and device) in float64 for
    a float64 ``dtype``, else in float32 (half the host memory at GPU-check
    sizes), then cast to ``dtype`` and moved to ``device``.
    """
    g = torch.Generator().manual_seed(seed)
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    shapes = ((n, b, hq, d), (n, b, hkv, d), (n, b, hkv, d), (n, b, hq, d))
    xs = [torch.randn(s, generator=g, dtype=draw) for s in shapes]
    return tuple(x.to(device=device, dtype=dtype) for x in xs)  # type: ignore[return-value]


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense float64 attention over the full sequence: out, dq, dk, dv (float64, q's device).

    q ``[n, b, hq, d]``, k, v ``[nk, b, hkv, d]`` (GQA/MQA: hq a multiple of
    hkv), dout like q; ``causal`` masks key j > query i; ``scale`` defaults to
    ``d ** -0.5``.
    """
    n, b, hq, d = q.shape
    nk, hkv = k.shape[0], k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    f64 = dict(dtype=torch.float64, device=q.device)
    out, dq = torch.empty(n, b, hq, d, **f64), torch.empty(n, b, hq, d, **f64)
    dk, dv = torch.empty(nk, b, hkv, d, **f64), torch.empty(nk, b, hkv, d, **f64)
    mask = torch.ones(n, nk, dtype=torch.bool, device=q.device).triu(1) if causal else None
    with torch.enable_grad():
        for h in range(hkv):
            hs, ks = slice(h * g, (h + 1) * g), slice(h, h + 1)
            qh = q[:, :, hs].detach().double().requires_grad_()  # [n, b, g, d]
            kh = k[:, :, ks].detach().double().requires_grad_()  # [n, b, 1, d]
            vh = v[:, :, ks].detach().double().requires_grad_()
            s = torch.einsum("qbhd,kbzd->bhqk", qh, kh) * scale  # (b, g, n, nk)
            if mask is not None:
                s = s.masked_fill(mask, -math.inf)
            o = torch.einsum("bhqk,kbzd->qbhd", s.softmax(-1), vh)  # [n, b, g, d]
            o.backward(dout[:, :, hs].double())
            out[:, :, hs], dq[:, :, hs] = o.detach(), qh.grad
            dk[:, :, ks], dv[:, :, ks] = kh.grad, vh.grad
    return out, dq, dk, dv


def shard(x: Tensor, rank: int, p: int, causal: bool, dim: int = 0) -> Tensor:
    """Rank ``rank``'s shard of ``p``: zigzag for causal, a contiguous split otherwise."""
    return zigzag_shard(x, rank, p, dim) if causal else x.chunk(p, dim=dim)[rank]


def unshard(shards: Sequence[Tensor], causal: bool, dim: int = 0) -> Tensor:
    """Inverse of ``shard`` over every rank's shard, in rank order."""
    return zigzag_unshard(shards, dim) if causal else torch.cat(list(shards), dim=dim)


def rel_err(got: Tensor, ref: Tensor) -> float:
    """Max absolute error relative to the reference's max magnitude."""
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
