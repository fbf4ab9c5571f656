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
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    causal: bool,
    scale: float | None = None,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Dense float64 attention over the full sequence: out, dq, dk, dv (float64, q's device),
    and with ``sinks`` their gradient too.

    q ``[n, b, hq, d]``, k, v ``[nk, b, hkv, d]`` (GQA/MQA: hq a multiple of
    hkv), dout like q; ``causal`` masks key j > query i; ``scale`` defaults to
    ``d ** -0.5``. Optional, for self-attention (n == nk): ``window=(left, right)`` keeps
    keys ``i - left .. i + right`` (-1 unbounded), ``softcap`` caps the scaled logits,
    ``sinks`` ``[hq]`` join each row's softmax denominator, ``doc_ids`` ``[n]`` keeps
    attention inside each document (packed sequences).
    """
    n, b, hq, d = q.shape
    nk, hkv = k.shape[0], k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    f64 = dict(dtype=torch.float64, device=q.device)
    out, dq = torch.empty(n, b, hq, d, **f64), torch.empty(n, b, hq, d, **f64)
    dk, dv = torch.empty(nk, b, hkv, d, **f64), torch.empty(nk, b, hkv, d, **f64)
    d_sinks = torch.zeros(hq, **f64)
    keep = torch.ones(n, nk, dtype=torch.bool, device=q.device)
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(nk, device=q.device)[None]
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left != -1:
            keep &= j >= i - left
        if right != -1:
            keep &= j <= i + right
    if doc_ids is not None:
        keep &= doc_ids.to(q.device)[:, None] == doc_ids.to(q.device)[None, :]
    with torch.enable_grad():
        for h in range(hkv):
            hs, ks = slice(h * g, (h + 1) * g), slice(h, h + 1)
            qh = q[:, :, hs].detach().double().requires_grad_()  # [n, b, g, d]
            kh = k[:, :, ks].detach().double().requires_grad_()  # [n, b, 1, d]
            vh = v[:, :, ks].detach().double().requires_grad_()
            s = torch.einsum("qbhd,kbzd->bhqk", qh, kh) * scale  # (b, g, n, nk)
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~keep, -math.inf)
            if sinks is not None:
                sh = sinks[hs].detach().double().requires_grad_()
                col = sh.view(1, g, 1, 1).expand(b, g, n, 1)
                prob = torch.cat((s, col), -1).softmax(-1)[..., :nk]
            else:
                prob = s.softmax(-1)
            prob = prob.nan_to_num(0.0)  # rows that see no key (padding)
            o = torch.einsum("bhqk,kbzd->qbhd", prob, vh)  # [n, b, g, d]
            o.backward(dout[:, :, hs].double())
            out[:, :, hs], dq[:, :, hs] = o.detach(), qh.grad
            dk[:, :, ks], dv[:, :, ks] = kh.grad, vh.grad
            if sinks is not None:
                d_sinks[hs] = sh.grad
    if sinks is not None:
        return out, dq, dk, dv, d_sinks
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
