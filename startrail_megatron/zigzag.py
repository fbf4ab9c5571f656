"""Megatron's zigzag sequence layout for causal load balance.

The sequence is cut into 2P equal chunks; CP rank r holds chunks r and
2P-1-r, concatenated (exactly ``megatron.core.utils.get_batch_on_this_cp_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["inverse_order", "reorder_chunks", "zigzag_shard", "zigzag_unshard"]


def zigzag_shard(x: Tensor, cp_rank: int, cp_size: int, dim: int = 0) -> Tensor:
    """This CP rank's zigzag shard of ``x`` along ``dim``: chunks r and 2P-1-r of 2P."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    n = x.shape[dim]
    if n % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {n} (dim {dim}) must be divisible by 2*cp_size = {2 * cp_size}"
        )
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=dim)


def zigzag_unshard(shards: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Inverse of ``zigzag_shard``: every rank's shard, in CP rank order -> full sequence."""
    p = len(shards)
    if p == 0:
        raise ValueError("zigzag_unshard needs at least one shard")
    n = shards[0].shape[dim]
    if any(s.shape[dim] != n for s in shards) or n % 2 != 0:
        raise ValueError(
            f"every shard must have the same even length along dim {dim}; got "
            f"{[s.shape[dim] for s in shards]}"
        )
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


def reorder_chunks(x: Tensor, order: Sequence[int], dim: int = 0) -> Tensor:
    """Cut ``x`` into ``len(order)`` equal chunks along ``dim`` and put chunk ``order[i]`` i-th.

    The identity order returns ``x`` itself (no copy).
    """
    if list(order) == sorted(order):
        return x
    chunks = x.chunk(len(order), dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def inverse_order(order: Sequence[int]) -> list[int]:
    """The permutation that undoes ``reorder_chunks(x, order)``."""
    return sorted(range(len(order)), key=order.__getitem__)
