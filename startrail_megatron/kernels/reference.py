"""The exact reference kernel: pure PyTorch, any device and dtype, float64-capable."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .contract import Dropout, acc_dtype
from .spec import ALL_FLOAT, BackendSpec

__all__ = ["TorchKernel", "dropout_keep"]


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


def dropout_keep(rec: Dropout, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """The keep mask (True = kept) of one call, ``shape`` ``(b, hkv, g, sq, sk)``.

    The first call on a record draws from ``rec.generator`` (or the device's default
    generator, advancing it) and saves the state it started from in ``rec.state``; later
    calls rebuild the same mask from that state without touching any generator.
    """
    if rec.state is None:
        gen = rec.generator if rec.generator is not None else _default_generator(device)
        rec.state = gen.get_state()
    else:
        gen = torch.Generator(device=device)
        gen.set_state(rec.state)
    return torch.rand(shape, generator=gen, device=device) >= rec.p


def _finite_lse(lse: Tensor) -> Tensor:
    """lse with -inf (rows that see no key) replaced by +inf so exp(s - lse) = 0."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


class TorchKernel:
    """Pure-PyTorch attention in the accumulation dtype: the reference kernel."""

    name = "torch"
    # sliding windows: ``band=(lo, hi)``, pairs with lo <= j - i <= hi
    spec = BackendSpec(
        name, frozenset({"cpu", "cuda", "meta"}), ALL_FLOAT, window=True, softcap=True
    )
    supports_dropout = spec.dropout
    supports_band = spec.window
    supports_softcap = spec.softcap

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, band=None, softcap=0.0):
        """Scaled scores (b, hkv, g, sq, sk), soft-capped (``cap * tanh(s / cap)``) and
        masked; with ``softcap`` also the factor ``1 - tanh^2`` of its gradient."""
        sq, b, hq, d = q.shape
        sk, _, hkv, _ = k.shape
        g = hq // hkv
        dt = acc_dtype(q.dtype)
        qg = q.to(dt).permute(1, 2, 0, 3).reshape(b, hkv, g, sq, d)  # (b, hkv, g, sq, d)
        kg = k.to(dt).permute(1, 2, 0, 3).unsqueeze(2)  # (b, hkv, 1, sk, d)
        s = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # (b, hkv, g, sq, sk)
        cap_grad = None
        if softcap:
            t = torch.tanh(s / softcap)
            s, cap_grad = softcap * t, 1 - t * t
        mask = None
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        if band is not None:
            rel = torch.arange(sk, device=q.device) - torch.arange(sq, device=q.device)[:, None]
            lo, hi = band
            out = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
            if lo is not None:
                out |= rel < lo
            if hi is not None:
                out |= rel > hi
            mask = out if mask is None else mask | out
        if mask is not None:
            s = s.masked_fill(mask, -math.inf)
        return s, cap_grad

    def forward(
        self, q, k, v, *, causal, scale, dropout: Dropout | None = None, band=None, softcap=0.0
    ):
        sq, b, hq, d = q.shape
        s, _ = self._scores(q, k, causal, scale, band, softcap)
        lse = torch.logsumexp(s, dim=-1)  # (b, hkv, g, sq)
        p = torch.exp(s - _finite_lse(lse).unsqueeze(-1))
        if dropout is not None:  # the statistics stay those before dropout
            p = p * (dropout_keep(dropout, tuple(p.shape), q.device).to(p.dtype) / (1 - dropout.p))
        vg = v.to(s.dtype).permute(1, 2, 0, 3).unsqueeze(2)  # (b, hkv, 1, sk, d)
        out = torch.matmul(p, vg)  # (b, hkv, g, sq, d)
        out = out.reshape(b, hq, sq, d).permute(2, 0, 1, 3).to(q.dtype)
        return out, lse.reshape(b, hq, sq)

    def backward(
        self, dout, q, k, v, out, lse, *, causal, scale, dropout: Dropout | None = None,
        band=None, softcap=0.0,
    ):  # fmt: skip
        sq, b, hq, d = q.shape
        sk, _, hkv, _ = k.shape
        g = hq // hkv
        s, cap_grad = self._scores(q, k, causal, scale, band, softcap)
        dt = s.dtype
        lse_g = _finite_lse(lse.to(dt)).reshape(b, hkv, g, sq, 1)
        p = torch.exp(s - lse_g)  # (b, hkv, g, sq, sk)

        def heads(x: Tensor, h: int) -> Tensor:  # [s, b, h, d] -> (b, hkv, h/hkv, s, d)
            return x.to(dt).permute(1, 2, 0, 3).reshape(b, hkv, h // hkv, x.shape[0], d)

        do, o = heads(dout, hq), heads(out, hq)
        kg, vg, qg = heads(k, hkv), heads(v, hkv), heads(q, hq)
        delta = (do * o).sum(-1, keepdim=True)  # (b, hkv, g, sq, 1); o is the dropped output
        dp = torch.matmul(do, vg.transpose(-1, -2))  # (b, hkv, g, sq, sk)
        if dropout is None:
            dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # (b, hkv, sk, d)
        else:  # the forward's mask, rebuilt from its saved state
            keep = dropout_keep(dropout, tuple(p.shape), q.device).to(dt) / (1 - dropout.p)
            dv = torch.matmul((p * keep).transpose(-1, -2), do).sum(2)
            dp = dp * keep
        ds = p * (dp - delta) * scale
        if cap_grad is not None:  # d/ds of cap * tanh(s / cap)
            ds = ds * cap_grad
        dq = torch.matmul(ds, kg)  # (b, hkv, g, sq, d)
        dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2)  # (b, hkv, sk, d)
        dq = dq.reshape(b, hq, sq, d).permute(2, 0, 1, 3)
        return dq, dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)
