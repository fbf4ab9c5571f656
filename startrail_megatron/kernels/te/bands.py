"""The TE calls of a band call (sliding windows): ``window_size`` pieces on the
top-left diagonal, each with no more rows than keys."""

from __future__ import annotations

import functools

__all__ = ["BandPiece", "piece_mask", "te_band_pieces"]

BandPiece = tuple[int, int, int, int, int, int]
"""(q_lo, q_hi, kv_lo, kv_hi, left, right): one TE call on rows [q_lo, q_hi) x keys
[kv_lo, kv_hi) with ``window_size=(left, right)`` on the top-left diagonal (-1: unbounded)."""


@functools.lru_cache(maxsize=4096)
def te_band_pieces(sq: int, sk: int, lo: int | None, hi: int | None) -> tuple[BandPiece, ...]:
    """TE calls for a band call ``lo <= j - i <= hi`` of ``sq`` queries and ``sk`` keys
    (``schedule.windows``' trimmed band calls: every row and key has a pair, so lo <= 0 <= hi).

    TE takes a window only with ``max_seqlen_q <= max_seqlen_kv`` (its backend table), so a
    call with more rows than keys is cut into runs of rows, each with no more rows than
    the keys they see, and each trimmed to those keys; its band moves with the cut. Rows
    are disjoint (outputs concatenate), keys may overlap (their gradients add). One piece,
    the call itself, when sq <= sk or nothing is masked. ``ValueError`` for a band with
    lo > 0 or hi < 0.
    """
    if (lo is not None and lo > 0) or (hi is not None and hi < 0):
        raise ValueError(f"band ({lo}, {hi}) of a {sq} x {sk} call is not trimmed (lo <= 0 <= hi)")

    def window(a: int, c0: int) -> tuple[int, int]:
        shift = c0 - a  # local j - i of the piece = global j - i - shift
        return (-1 if lo is None else shift - lo, -1 if hi is None else hi - shift)

    if sq <= sk or window(0, 0) == (-1, -1):  # a band with nothing masked: one plain call
        return ((0, sq, 0, sk, *window(0, 0)),)

    def first_key(a: int) -> int:
        return 0 if lo is None else max(0, a + lo)

    def last_key(e: int) -> int:  # the last key row e - 1 sees
        return sk - 1 if hi is None else min(sk - 1, e - 1 + hi)

    out: list[BandPiece] = []
    a = 0
    while a < sq:
        e = a + 1
        while e < sq and e + 1 - a <= last_key(e + 1) - first_key(a) + 1:
            e += 1
        c0, c1 = first_key(a), last_key(e) + 1
        out.append((a, e, c0, c1, *window(a, c0)))
        a = e
    return tuple(out)


def piece_mask(left: int, right: int) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window) of a piece's ``window_size``: TE's own causal call for (-1, 0) and
    the plain one for (-1, -1), as ``DotProductAttention`` passes them; a band otherwise."""
    if (left, right) == (-1, 0):
        return True, None
    if (left, right) == (-1, -1):
        return False, None
    return False, (left, right)
