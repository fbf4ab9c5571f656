"""Attention under a per-batch CP layout (``schedule/batch.py``'s Note [per-batch CP
layouts]): each rank runs StarTrail over its block of the layout, on the packed documents
the block holds, with the block's team size.

``BatchGroups.create`` makes, once, StarTrail's groups for every aligned block of every
size it is given and every team size that fits (a collective over the default world, like
``StarTrailGroups.create``: the blocks of one size are the same sub-groups in every batch).
``batch_attention`` then takes one batch's ``BatchLayout``: this rank's block, its packed
layout and its groups, and calls ``startrail_attention`` with the block's ``cu_seqlens``
(any of its options pass through). ``shard_batch`` / ``unshard_batch`` move the batch's
concatenated documents (in batch order, unpadded) to each rank's local rows and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from .attention import startrail_attention
from .comm import check_agreement
from .groups import StarTrailGroups, every_cp_group, group_timeout
from .schedule.batch import BatchLayout
from .schedule.layout import divisors, valid_team_sizes
from .zigzag import shard_packed, unshard_packed

__all__ = ["BatchGroups", "batch_attention", "shard_batch", "unshard_batch"]


@dataclass(frozen=True)
class BatchGroups:
    """StarTrail's groups of this rank's block for every (block size, team size) made.

    Attributes:
        cp_size: P, the ranks a layout spreads over (the CP group's).
        cp_rank: this rank's index among them.
        groups: ``(size, team_size) -> StarTrailGroups`` over this rank's block of ``size``
            (ranks ``[cp_rank // size * size, ... + size)``).
        cp_group: the group the layouts spread over (``None``: the world).
        agreed: the layouts (fingerprints) every rank was checked to run.
    """

    cp_size: int
    cp_rank: int
    groups: dict = field(repr=False)
    cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    agreed: set = field(default_factory=set, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        cp_group: dist.ProcessGroup | None = None,
        sizes=None,
        *,
        timeout: timedelta | None = None,
        own_rows_first: bool | None = None,
    ) -> BatchGroups:
        """Groups for every block size in ``sizes`` (default: every divisor of the CP size)
        and every team size that fits it. Every rank of the default world calls it, with
        the same arguments, at the same point; with several CP groups (one per data-parallel
        replica) each rank passes its own, and every block of every one is made. ``ValueError`` before any communication for
        a size that does not divide the CP size. ``own_rows_first``: every group's
        (``StarTrailGroups.create``)."""
        if not dist.is_initialized():
            raise RuntimeError("BatchGroups.create needs torch.distributed to be initialized")
        p = dist.get_world_size(cp_group)
        allowed = divisors(p)
        sizes = allowed if sizes is None else sorted(set(sizes))
        bad = [k for k in sizes if k not in allowed]
        if bad:
            raise ValueError(f"block sizes {bad} do not divide the CP size {p}; allowed: {allowed}")
        rank = dist.get_rank(cp_group)
        if timeout is None:
            timeout = group_timeout(cp_group)
        # with several CP groups (data-parallel replicas), every rank makes every block of
        # every CP group, in the same order
        glob, every = every_cp_group(cp_group, tuple(sizes), "BatchGroups' block sizes")
        made = {}
        for k in sizes:
            mine = None
            for ranks in every:
                for start in range(0, p, k):  # every block of this size, same order everywhere
                    g = dist.new_group(
                        list(ranks[start : start + k]), timeout=timeout,
                        group_desc=f"startrail_block_{k}",
                    )  # fmt: skip
                    if ranks == glob and start <= rank < start + k:
                        mine = g
            for c in valid_team_sizes(k):
                made[(k, c)] = StarTrailGroups.create(
                    c, mine, timeout=timeout, own_rows_first=own_rows_first
                )
        return cls(p, rank, made, cp_group)

    def get(self, size: int, team_size: int) -> StarTrailGroups:
        """This rank's groups for a block of ``size`` with ``team_size``; ``ValueError``
        naming what was made where that pair was not."""
        g = self.groups.get((size, team_size))
        if g is None:
            raise ValueError(
                f"no StarTrail groups for a block of {size} ranks with team_size {team_size}; "
                f"made: {sorted(self.groups)} (BatchGroups.create(sizes=...))"
            )
        return g


def _block_docs(x: Tensor, layout: BatchLayout, docs) -> Tensor:
    """The rows of ``docs`` (batch indices) from the batch's concatenation, in that order."""
    cu = [0]
    for n in layout.lengths:
        cu.append(cu[-1] + n)
    parts = [x[cu[d] : cu[d + 1]] for d in docs]
    return torch.cat(parts) if parts else x[:0]


def shard_batch(x: Tensor, layout: BatchLayout, rank: int, fill: float = 0) -> Tensor:
    """``rank``'s local rows of ``x``, the batch's documents concatenated in batch order
    (``[sum(lengths), ...]``): its block's documents packed and zigzag-sharded over the
    block (``zigzag.shard_packed``; ``fill`` on the padding, e.g. -100 for labels)."""
    b = layout.block_of(rank)
    if layout.idle(b):  # no rows
        return x[:0]
    packed = layout.packed(b)
    return shard_packed(_block_docs(x, layout, b.docs), packed, rank - b.start, fill=fill)


def unshard_batch(parts, layout: BatchLayout) -> Tensor:
    """The batch's concatenation from every rank's local rows (``parts[r]``: rank r's)."""
    n = sum(layout.lengths)
    out = parts[0].new_zeros((n, *parts[0].shape[1:]))
    cu = [0]
    for length in layout.lengths:
        cu.append(cu[-1] + length)
    for b in layout.blocks:
        if layout.idle(b):
            continue
        packed = layout.packed(b)
        whole = unshard_packed([parts[r] for r in b.ranks], packed)
        at = 0
        for d in b.docs:
            out[cu[d] : cu[d + 1]] = whole[at : at + layout.lengths[d]]
            at += layout.lengths[d]
    return out


def _agree_on_layout(layout: BatchLayout, groups: BatchGroups, device) -> None:
    """The first time this rank runs ``layout``: every rank of the group checks that the
    others run the same (ranks that disagree would wait on sub-groups the others never
    join); all raise the same ``ValueError`` where they do not (``validation.check_agreement``:
    one tiny all-reduce and one read of it per new layout)."""
    fp = layout.fingerprint()
    if fp in groups.agreed or groups.cp_size == 1:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    check_agreement(groups.cp_group, {"batch layout (BatchLayout.fingerprint)": fp}, device)
    if len(groups.agreed) > 256:  # one per batch: keep the set small
        groups.agreed.clear()
    groups.agreed.add(fp)


def batch_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: BatchLayout, groups: BatchGroups, **options
) -> Tensor:
    """Exact attention of every document of the batch, under ``layout``: this rank's
    ``q``, ``k``, ``v`` are its block's packed rows (``shard_batch``); it runs
    ``startrail_attention`` over its block with the block's team size and packed layout
    (``options``: the rest of ``startrail_attention``'s arguments, e.g. ``causal``,
    ``kernel``, ``ledger``, ``window``). ``ValueError`` before any transfer where the
    layout is for another number of ranks, or its local rows do not match ``q``, and on
    every rank where the ranks pass different layouts (one tiny all-reduce over the group
    the first time a rank sees a layout). Every rank of the group calls it, a rank whose
    block holds no token too (with its 0 rows: it joins that check, and returns them)."""
    if layout.cp_size != groups.cp_size:
        raise ValueError(
            f"the layout is for {layout.cp_size} ranks; the groups span {groups.cp_size}"
        )
    for name in ("cu_seqlens", "cu_seqlens_padded"):
        if name in options:
            raise ValueError(f"{name} comes from the layout; do not pass it to batch_attention")
    _agree_on_layout(layout, groups, q.device)
    b = layout.block_of(groups.cp_rank)
    if layout.idle(b):  # nothing to attend, nothing sent
        if q.shape[0]:
            raise ValueError(
                f"q has {q.shape[0]} rows; rank {groups.cp_rank}'s block of the layout holds "
                "no token (shard_batch gives 0 rows)"
            )
        return q.clone()
    packed = layout.packed(b)
    if q.shape[0] != packed.s_local:
        raise ValueError(
            f"q has {q.shape[0]} rows; rank {groups.cp_rank}'s block of the layout holds "
            f"{packed.s_local} (shard_batch gives them)"
        )
    return startrail_attention(
        q, k, v, groups.get(b.size, b.team_size), cu_seqlens=packed.cu_seqlens,
        cu_seqlens_padded=packed.cu_seqlens_padded, **options,
    )  # fmt: skip
