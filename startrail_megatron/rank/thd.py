"""THD gathers: a ``VarlenCall``'s team-buffer rows as the packed ``[tokens, h, d]``
tensors (and cumulative offsets) that variable-length kernels take, and back."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ..schedule import VarlenCall
from .team_order import index_tensor

__all__ = ["VarlenIndex", "from_thd", "to_thd", "varlen_index"]


@dataclass(frozen=True)
class VarlenIndex:
    """A ``VarlenCall`` as tensors: the team-buffer rows it gathers (one batch row's
    worth: every batch row has the same documents) and the THD offsets of its
    ``b * len(segments)`` sequences (batch-major, as the gathered rows are laid out)."""

    q_rows: Tensor
    kv_rows: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal: bool


def _rows_and_offsets(segments, b: int, device) -> tuple[Tensor, Tensor, int]:
    rows = [i for lo, hi in segments for i in range(lo, hi)]
    lens = [hi - lo for lo, hi in segments] * b
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return (
        index_tensor(rows, torch.long, device),
        index_tensor(cu, torch.int32, device),
        max(lens),
    )


@lru_cache(maxsize=64)  # the calls of the batches in flight, on each device
def varlen_index(call: VarlenCall, b: int, device: torch.device) -> VarlenIndex:
    q_rows, cu_q, max_q = _rows_and_offsets(call.q_segments, b, device)
    kv_rows, cu_k, max_k = _rows_and_offsets(call.kv_segments, b, device)
    return VarlenIndex(q_rows, kv_rows, cu_q, cu_k, max_q, max_k, call.causal)


def to_thd(x: Tensor, rows: Tensor) -> Tensor:
    """Team-buffer rows ``[n, b, h, d]`` -> the THD tensor ``[b * len(rows), h, d]`` of
    those rows, batch-major (a copy; no second one when b == 1)."""
    g = x.index_select(0, rows)
    return g.transpose(0, 1).reshape(-1, *g.shape[2:])


def from_thd(x: Tensor, b: int) -> Tensor:
    """THD ``[b * t, h, d]`` (batch-major) -> ``[t, b, h, d]`` (a view)."""
    return x.view(b, -1, *x.shape[1:]).transpose(0, 1)
