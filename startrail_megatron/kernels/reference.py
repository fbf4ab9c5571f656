"""The exact reference kernel: pure PyTorch, any device and dtype, float64-capable."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .contract import acc_dtype

__all__ = ["TorchKernel"]


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
