"""Megatron's zigzag sequence layout for causal load balance.

The sequence is cut into 2P equal chunks; CP rank r holds chunks r and
2P-1-r, concatenated (exactly ``megatron.core.utils.get_batch_on_this_cp_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .schedule.packing import PackedLayout

__all__ = [
    "inverse_order",
    "reorder_chunks",
    "reorder_chunks_",
    "shard_packed",
    "unshard_packed",
    "zigzag_shard",
    "zigzag_unshard",
]


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


def reorder_chunks_(x: Tensor, order: Sequence[int]) -> Tensor:
    """``reorder_chunks(x, order)`` (dim 0) in ``x``'s own storage, which it returns: each
    cycle of the permutation moves its chunks one place, through one chunk-sized copy, so
    the transient is one chunk, not a second ``x``. ``x`` may be a strided view. Rows that
    do not split evenly are reordered through a copy, as ``reorder_chunks`` cuts them."""
    n = len(order)
    if list(order) == sorted(order):
        return x
    if x.shape[0] % n:  # unequal chunks (as ``reorder_chunks`` cuts them): through a copy
        x.copy_(reorder_chunks(x, order))
        return x
    chunks = x.chunk(n, dim=0)
    seen = [False] * n
    for start in range(n):
        if seen[start] or order[start] == start:
            seen[start] = True
            continue
        held = chunks[start].clone()  # chunk `start` is overwritten first
        i = start
        while True:
            seen[i] = True
            src = order[i]
            if src == start:
                chunks[i].copy_(held)
                break
            chunks[i].copy_(chunks[src])
            i = src
    return x


def inverse_order(order: Sequence[int]) -> list[int]:
    """The permutation that undoes ``reorder_chunks(x, order)``."""
    return sorted(range(len(order)), key=order.__getitem__)


def shard_packed(
    x: Tensor, layout: PackedLayout, cp_rank: int, dim: int = 0, fill: float = 0
) -> Tensor:
    """This CP rank's per-document zigzag shard of packed documents.

    ``x`` holds the documents' real tokens one after another along ``dim``
    (``layout.cu_seqlens[-1]`` of them, THD style); the shard has ``layout.s_local``
    rows: per document, its chunks ``cp_rank`` and ``2P-1-cp_rank`` of the document
    padded to ``layout.padded_lengths``, with ``fill`` where the padding is (e.g. -100
    for labels).
    """
    if not 0 <= cp_rank < layout.cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={layout.cp_size})")
    if x.shape[dim] != layout.cu_seqlens[-1]:
        raise ValueError(
            f"x has {x.shape[dim]} rows along dim {dim}, but cu_seqlens holds "
            f"{layout.cu_seqlens[-1]} real tokens"
        )
    xd = x.movedim(dim, 0)
    out = xd.new_full((layout.s_local, *xd.shape[1:]), fill)
    for src, dst, n in layout.local_rows(cp_rank):
        out[dst : dst + n] = xd[src : src + n]
    return out.movedim(0, dim)


def unshard_packed(shards: Sequence[Tensor], layout: PackedLayout, dim: int = 0) -> Tensor:
    """Inverse of ``shard_packed`` over every rank's shard (CP rank order): the real tokens
    one after another, padding dropped."""
    if len(shards) != layout.cp_size:
        raise ValueError(f"need {layout.cp_size} shards (one per CP rank), got {len(shards)}")
    moved = [s.movedim(dim, 0) for s in shards]
    if any(m.shape[0] != layout.s_local for m in moved):
        raise ValueError(
            f"every shard must have s_local = {layout.s_local} rows along dim {dim}; got "
            f"{[m.shape[0] for m in moved]}"
        )
    out = moved[0].new_empty((layout.cu_seqlens[-1], *moved[0].shape[1:]))
    for r, m in enumerate(moved):
        for dst, src, n in layout.local_rows(r):
            out[dst : dst + n] = m[src : src + n]
    return out.movedim(0, dim)
