"""One backend's variant case (``features.check_features``): its sizes, its result rows,
its errors against float64, and the one-process StarTrail run over zigzag shards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..one_process import one_process_attention
from ..testing import rel_err, unshard
from ..zigzag import zigzag_shard
from .sizes import tolerance

__all__ = ["GRAD_NAMES", "FeatureCase"]

GRAD_NAMES = ("out", "dq", "dk", "dv")
"""The tensors compared, in the order the runs return them."""


@dataclass(frozen=True)
class FeatureCase:
    """One backend (``kernel_name``, built as ``kernel``) on P ranks in teams of C, causal,
    ``hq``/``hkv`` heads, ``s_local`` tokens per rank."""

    kernel_name: str
    kernel: Any
    p: int
    c: int
    hq: int
    hkv: int
    s_local: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def tokens(self) -> int:
        """The whole sequence, P * s_local."""
        return self.p * self.s_local

    @property
    def tolerance(self) -> float:
        return tolerance(self.dtype, self.hq != self.hkv)

    def row(self, feature: str, **fields: Any) -> dict[str, Any]:
        """The JSON row of ``feature``: the case, then ``fields``."""
        return dict(
            backend=self.kernel_name, dtype=str(self.dtype).removeprefix("torch."),
            feature=feature, P=self.p, C=self.c, heads_q=self.hq, heads_kv=self.hkv,
            tokens_per_rank=self.s_local, **fields,
        )  # fmt: skip

    def errors(
        self, got: list[Tensor], want: list[Tensor], names: tuple[str, ...] = GRAD_NAMES
    ) -> tuple[dict[str, float], bool]:
        """(max relative error per name, whether all are finite and within tolerance)."""
        errs = {k: rel_err(g, w) for k, g, w in zip(names, got, want)}
        return errs, all(math.isfinite(x) and x <= self.tolerance for x in errs.values())

    def run_zigzag(self, q: Tensor, k: Tensor, v: Tensor, do: Tensor, **options: Any):
        """One-process StarTrail, causal, on zigzag shards: [out, dq, dk, dv] unsharded."""
        p = self.p
        leaves = [[zigzag_shard(x, r, p).clone().requires_grad_() for r in range(p)]
                  for x in (q, k, v)]  # fmt: skip
        outs = one_process_attention(*leaves, self.c, kernel=self.kernel, **options)
        torch.autograd.backward(outs, [zigzag_shard(do, r, p) for r in range(p)])
        got = [outs, *([x.grad for x in xs] for xs in leaves)]
        return [unshard([t.detach() for t in g], True) for g in got]
