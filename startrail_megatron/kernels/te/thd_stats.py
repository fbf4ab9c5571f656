"""Rows of TE's softmax statistics of packed (THD) sequences."""

from __future__ import annotations


def te_max_tokens(t: int) -> int:
    """Rows of TE 1.13 - 2.10's THD softmax statistics for t tokens (``get_max_tokens`` in
    TE's ``fused_attn_f16_arbitrary_seqlen.cu``): 1024 up to 1024 tokens, then the next
    power of two up to 32K, then the next multiple of 32K."""
    if t <= 1024:
        return 1024
    if t <= 32768:
        return 1 << (t - 1).bit_length()
    return -(-t // 32768) * 32768
