"""What both peers share: the CP group's rank and size, and the natural chunk order
of a rank-ordered gathered zigzag buffer."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["cp_rank_and_size", "natural_order"]


def cp_rank_and_size(cp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in the CP group (``None``: the world); an error before init."""
    if not dist.is_initialized():
        raise RuntimeError("this attention needs torch.distributed to be initialized")
    return dist.get_rank(cp_group), dist.get_world_size(cp_group)


def natural_order(p: int) -> list[int]:
    """Chunk positions of the rank-ordered gathered buffer, in global chunk order.

    The gathered buffer holds ``[c0, c(2P-1), c1, c(2P-2), ...]``; chunk ``j`` sits
    at position ``2j`` for ``j < P`` and at ``2(2P-1-j) + 1`` otherwise.
    """
    return [2 * j if j < p else 2 * (2 * p - 1 - j) + 1 for j in range(2 * p)]
