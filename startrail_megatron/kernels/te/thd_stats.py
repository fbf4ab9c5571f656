"""TE's softmax statistics of packed (THD) sequences: their three forms, and the
contract's ``[h, t]`` lse to and from them."""

from __future__ import annotations

import torch
from torch import Tensor

from ..contract import acc_dtype, varlen_lse_packed, varlen_lse_padded

__all__ = ["te_max_tokens", "thd_stats_from_packed", "thd_stats_to_packed"]


def te_max_tokens(t: int) -> int:
    """Rows of TE 1.13 - 2.10's THD softmax statistics for t tokens (``get_max_tokens`` in
    TE's ``fused_attn_f16_arbitrary_seqlen.cu``): 1024 up to 1024 tokens, then the next
    power of two up to 32K, then the next multiple of 32K."""
    if t <= 1024:
        return 1024
    if t <= 32768:
        return 1 << (t - 1).bit_length()
    return -(-t // 32768) * 32768


def thd_stats_to_packed(
    stats: Tensor, cu_q: Tensor, t: int, h: int, dtype: torch.dtype, version: str
) -> tuple[Tensor, str]:
    """TE's THD softmax statistics -> (``[h, t]``, their form). Three forms, by TE
    release, cuDNN and GPU: ``"padded"`` ``[n_seqs, h, max_seqlen_q, 1]`` (per sequence;
    TE 1.9 - 1.12, cuDNN < 9.6, sm120), ``"bucketed"`` ``[te_max_tokens(t), h, 1]`` (TE
    1.13 - 2.10 round the rows up) and ``"exact"`` ``[t, h, 1]`` (2.11+). Anything else
    raises, naming TE ``version``."""
    n = cu_q.shape[0] - 1
    if stats.dim() == 4 and tuple(stats.shape[:2]) == (n, h) and stats.shape[3] == 1:
        form, packed = "padded", varlen_lse_packed(stats.squeeze(-1), cu_q, t)
    elif stats.dim() == 3 and tuple(stats.shape[1:]) == (h, 1) and stats.shape[0] >= t:
        rows = stats.shape[0]
        form = "exact" if rows == t else "bucketed"
        if form == "bucketed" and rows != te_max_tokens(t):
            raise RuntimeError(
                f"Transformer Engine {version}: THD softmax statistics of "
                f"{rows} rows for {t} tokens; expected {t} or {te_max_tokens(t)}"
            )
        packed = stats[:t, :, 0].transpose(0, 1)
    else:
        raise RuntimeError(
            f"Transformer Engine {version}: THD softmax statistics of shape "
            f"{tuple(stats.shape)}; expected [{n}, {h}, max_seqlen_q, 1] or [>= {t}, {h}, 1]"
        )
    return packed.to(acc_dtype(dtype)), form


def thd_stats_from_packed(
    lse: Tensor, cu_q: Tensor, max_q: int, dtype: torch.dtype, form: str
) -> Tensor:
    """``[h, t]`` -> TE's THD softmax statistics in ``form`` (``thd_stats_to_packed``)."""
    h, t = lse.shape
    lse = lse.to(acc_dtype(dtype))
    if form == "padded":
        return varlen_lse_padded(lse, cu_q, max_q).unsqueeze(-1)
    stats = lse.new_zeros(te_max_tokens(t) if form == "bucketed" else t, h, 1)
    stats[:t, :, 0] = lse.transpose(0, 1)
    return stats
