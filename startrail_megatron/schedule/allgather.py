"""The all-gather-KV peer's kernel calls (``peers/allgather.py``), for the code and the
planner alike. Pure arithmetic, no torch."""

from __future__ import annotations

__all__ = ["allgather_calls"]


def allgather_calls(
    rank: int, cp_size: int, causal: bool, s_local: int
) -> list[tuple[slice, slice, bool]]:
    """Kernel calls of one all-gather-KV rank: (local q rows, rows of the natural-order
    gathered KV, causal).

    Causal, for CP rank r with zigzag chunks r and 2P-1-r (c tokens per chunk)::

        q chunk r        : full against chunks [0, r)        + causal on chunk r
        q chunk 2P-1-r   : full against chunks [0, 2P-1-r)   + causal on chunk 2P-1-r

    so every rank computes the same number of (q, k) pairs. Full: one call.
    """
    p = cp_size
    if not causal:
        return [(slice(0, s_local), slice(0, p * s_local), False)]
    c = s_local // 2
    out = []
    for half, chunk in ((0, rank), (1, 2 * p - 1 - rank)):
        qs = slice(half * c, (half + 1) * c)
        if chunk > 0:
            out.append((qs, slice(0, chunk * c), False))
        out.append((qs, slice(chunk * c, (chunk + 1) * c), True))
    return out
