"""The dense correctness check of one backend: one-process StarTrail against float64."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..one_process import one_process_attention
from ..testing import make_inputs, reference_attention, rel_err, shard, unshard
from .sizes import tolerance

__all__ = ["check_backend"]


def check_backend(
    kernel: Any,
    p: int,
    c: int,
    causal: bool,
    hq: int,
    hkv: int,
    s_local: int,
    batch: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    ref: tuple[Tensor, ...] | None = None,
) -> dict[str, Any]:
    """One-process StarTrail with ``kernel`` (a name or object) against float64.

    Returns the errors per tensor, the tolerance and ``passed``.
    """
    n = p * s_local
    q, k, v, do = make_inputs(seed, n, batch, hq, hkv, head_dim, dtype=dtype, device=device)
    if ref is None:
        ref = reference_attention(q, k, v, do, causal)
    leaves = [
        [shard(x, r, p, causal).clone().requires_grad_() for r in range(p)] for x in (q, k, v)
    ]
    outs = one_process_attention(*leaves, c, causal=causal, kernel=kernel)
    torch.autograd.backward(outs, [shard(do, r, p, causal) for r in range(p)])
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    errors = {}
    for name, shards, want in zip(("out", "dq", "dk", "dv"), got, ref):
        errors[name] = rel_err(unshard([s.detach() for s in shards], causal), want)
    tol = tolerance(dtype, hq != hkv)
    ok = all(math.isfinite(e) and e <= tol for e in errors.values())
    return {"errors": errors, "tolerance": tol, "passed": ok}
