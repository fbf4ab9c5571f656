"""The packed-documents case: documents of uneven lengths (flash-attn and TE take the
varlen / THD path) against float64 per document."""

from __future__ import annotations

from typing import Any

import torch

from ..one_process import one_process_attention
from ..schedule.packing import pack_lengths
from ..testing import make_inputs, reference_attention
from ..zigzag import shard_packed, unshard_packed
from .case import FeatureCase

__all__ = ["check_packed"]


def check_packed(case: FeatureCase) -> dict[str, Any]:
    """Five documents (one empty, one of one token) packed over P ranks: out, dq, dk, dv."""
    n, p, dtype, device = case.tokens, case.p, case.dtype, case.device
    lengths = [n // 2 + 3, 1, n // 4 - 7, 0, n // 8 + 5]
    lay = pack_lengths(lengths, p)
    q, k, v, do = make_inputs(1, sum(lengths), 1, case.hq, case.hkv, case.head_dim, dtype=dtype,
                              device=device)  # fmt: skip
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    want = reference_attention(q, k, v, do, True, doc_ids=docs)
    leaves = [[shard_packed(x, lay, r).clone().requires_grad_() for r in range(p)]
              for x in (q, k, v)]  # fmt: skip
    outs = one_process_attention(*leaves, case.c, kernel=case.kernel, cu_seqlens=lay.cu_seqlens,
                                 cu_seqlens_padded=lay.cu_seqlens_padded)  # fmt: skip
    torch.autograd.backward(outs, [shard_packed(do, lay, r) for r in range(p)])
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    errs, ok = case.errors([unshard_packed([t.detach() for t in g], lay) for g in got], want)
    return case.row("packed", errors=errs, tolerance=case.tolerance, passed=ok)
