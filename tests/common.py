"""Shared pieces of the multi-rank tests: inputs from one seed and the float64 reference."""

from __future__ import annotations

import math

import torch

import startrail_megatron as st

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
_GROUPS: dict = {}


def groups_for(team_size: int, placement: str = "team", cp_group=None, key=None):
    """Per-process cache: groups live as long as the pool's process group."""
    k = (team_size, placement, key)
    if k not in _GROUPS:
        _GROUPS[k] = st.StarTrailGroups.create(team_size, cp_group=cp_group, placement=placement)
    return _GROUPS[k]


def make_inputs(seed: int, n: int, b: int, hq: int, hkv: int, d: int):
    """Full-sequence q, k, v, dout in float64 (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, b, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, b, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, b, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(n, b, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def reference(q, k, v, dout, causal: bool, scale: float | None = None):
    """Dense float64 attention over the full sequence: out, dq, dk, dv."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    n, b, hq, d = q.shape
    hkv = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    kr = k.repeat_interleave(hq // hkv, dim=2)
    vr = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("qbhd,kbhd->bhqk", q, kr) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bhqk,kbhd->qbhd", torch.softmax(s, dim=-1), vr)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def shard(x, rank: int, p: int, causal: bool):
    """Causal: zigzag. Otherwise a plain contiguous split (any layout is allowed)."""
    return st.zigzag_shard(x, rank, p) if causal else x.chunk(p, dim=0)[rank]


def unshard(shards, causal: bool):
    return st.zigzag_unshard(shards) if causal else torch.cat(list(shards), dim=0)


def rel_err(got, ref) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()
