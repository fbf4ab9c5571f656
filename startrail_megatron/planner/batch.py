"""The per-batch scheduler: from a batch's document lengths, the ``BatchLayout`` (which
sub-group and team size runs each document, ``schedule/batch.py``'s Note [per-batch CP
layouts]) whose slowest rank the cost model predicts shortest.

Prices, from the planner's own model (``cluster``: a ``ClusterSpec``):
- a rank's kernels: its causal pairs at the cluster's attention rate, forward and
  backward (``compute.kernel_time``'s FLOP count, without its per-call overhead);
- a block's communication: StarTrail's bytes per rank for its size k and team size C
  (``strategies.comm_bytes``, linear in the tokens each rank holds), over the inside-node
  link where the block fits a node, else the node's link shared by its ranks
  (``ClusterSpec.inter_bw / gpus_per_node``); a block of one rank sends nothing. Each
  block size takes the team size with the fewest predicted seconds per token. A rank's
  time is its kernels and its block's communication, the longer of the two where the
  cluster overlaps transfers with compute (``ClusterSpec.overlap``), else their sum.

The search (greedy, O(documents x blocks)):
1. target = every rank's share of the batch's kernel time. A document whose kernel time
   exceeds it gets a block of its own: the smallest size k dividing P whose per-rank time
   (its kernels / k + its communication) is within the target (none: the size with the
   least), placed at the lowest
   aligned free start (longest documents first; where no aligned place is left, it joins
   the multi-rank block with the least time per rank).
2. The ranks left over are blocks of one.
3. The other documents, longest first, each go where the slowest rank's time grows least:
   onto the least loaded block of one, or into a multi-rank block (packed with its
   documents, sharded over its ranks).
Pure: no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from functools import cache

from ..schedule.batch import BatchBlock, BatchLayout, doc_pairs
from ..schedule.layout import valid_team_sizes
from .cluster import CLUSTER_PRESETS, ClusterSpec
from .shape import AttnShape

__all__ = ["BatchPrices", "schedule_batch"]

_REF_TOKENS = 1024  # tokens per rank at which a block's bytes per token are read


class BatchPrices:
    """Seconds per causal pair (kernels, forward + backward) and, per block size, the team
    size and seconds per local token of its communication, on ``cluster`` for one call
    shape (heads, head size, element bytes)."""

    def __init__(
        self,
        cluster: ClusterSpec,
        heads_q: int,
        heads_kv: int,
        head_dim: int,
        elem_bytes: int = 2,
        batch: int = 1,
    ) -> None:
        self.cluster = cluster
        self.dims = (heads_q, heads_kv, head_dim, elem_bytes, batch)
        flops_per_pair = 4 * head_dim * heads_q * batch
        self.pair_s = flops_per_pair / cluster.attn_flops * (1 + cluster.attn_bwd_ratio)

    @cache  # noqa: B019 - one instance per scheduling call, few sizes
    def team_and_token_s(self, size: int) -> tuple[int, float]:
        """(team size, communication seconds per local token) of a block of ``size``."""
        if size == 1:
            return 1, 0.0
        from .strategies import Strategy, comm_bytes

        hq, hkv, d, e, b = self.dims
        cl = self.cluster
        shape = AttnShape(size, _REF_TOKENS, b, hq, hkv, d, elem_bytes=e, acc_bytes=4)
        bw = cl.intra_bw if size <= cl.gpus_per_node else cl.inter_bw / cl.gpus_per_node
        best = None
        for c in valid_team_sizes(size):
            per_rank = comm_bytes(Strategy("startrail", c, "team"), shape)
            sent = max(sum(r.values()) for r in per_rank)
            s = sent / bw / _REF_TOKENS
            if best is None or s < best[1]:
                best = (c, s)
        return best


def _divisors(p: int) -> list[int]:
    return [d for d in range(1, p + 1) if p % d == 0]


def schedule_batch(
    lengths: Sequence[int],
    cp_size: int,
    *,
    heads_q: int = 32,
    heads_kv: int = 8,
    head_dim: int = 128,
    elem_bytes: int = 2,
    cluster: ClusterSpec | None = None,
) -> BatchLayout:
    """The batch's layout on ``cp_size`` ranks (module docstring), priced on ``cluster``
    (default: the ``h100-ib`` preset, its nodes holding ``min(cp_size, 8)`` ranks)."""
    p = cp_size
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {p!r}")
    lengths = tuple(lengths)
    if cluster is None:
        cluster = CLUSTER_PRESETS["h100-ib"].with_(gpus_per_node=min(p, 8))
    prices = BatchPrices(cluster, heads_q, heads_kv, head_dim, elem_bytes)
    pair_s = prices.pair_s
    comp = [doc_pairs(n) * pair_s for n in lengths]
    target = sum(comp) / p
    sizes = _divisors(p)

    def per_rank(size: int, comp_s: float, tokens: int) -> float:
        comm = prices.team_and_token_s(size)[1] * tokens / size
        # transfers in flight beside the kernels where the cluster overlaps them (the
        # sub-ring steps hide their K,V behind the previous step's calls), else after them
        return max(comp_s / size, comm) if cluster.overlap else comp_s / size + comm

    order = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    free = [True] * p
    blocks: list[dict] = []  # start, size, docs, comp, tokens
    small: list[int] = []
    for d in order:
        if comp[d] <= target or p == 1:
            small.append(d)
            continue
        fits = [k for k in sizes if per_rank(k, comp[d], lengths[d]) <= target] or [
            min(sizes, key=lambda k: per_rank(k, comp[d], lengths[d]))
        ]
        placed = False
        for k in (k for k in sizes if k >= fits[0]):
            start = next((s for s in range(0, p, k) if all(free[s : s + k])), None)
            if start is not None:
                for r in range(start, start + k):
                    free[r] = False
                blocks.append(dict(start=start, size=k, docs=[d], comp=comp[d], tokens=lengths[d]))
                placed = True
                break
        if not placed:  # no aligned room left: the least loaded multi-rank block takes it
            b = min(blocks, key=lambda b: per_rank(b["size"], b["comp"], b["tokens"]))
            b["docs"].append(d)
            b["comp"] += comp[d]
            b["tokens"] += lengths[d]
    singles = [dict(start=r, size=1, docs=[], comp=0.0, tokens=0) for r in range(p) if free[r]]
    heap = [(0.0, i) for i in range(len(singles))]
    for d in small:
        options = []
        if heap:
            t, i = heap[0]
            options.append((t + comp[d], 0, i))
        for j, b in enumerate(blocks):
            t = per_rank(b["size"], b["comp"] + comp[d], b["tokens"] + lengths[d])
            options.append((t, 1, j))
        _, kind, i = min(options)
        if kind == 0:
            heapq.heappop(heap)
            s = singles[i]
            s["docs"].append(d)
            s["comp"] += comp[d]
            heapq.heappush(heap, (s["comp"], i))
        else:
            b = blocks[i]
            b["docs"].append(d)
            b["comp"] += comp[d]
            b["tokens"] += lengths[d]
    out = [
        BatchBlock(b["start"], b["size"], prices.team_and_token_s(b["size"])[0],
                   tuple(sorted(b["docs"])))
        for b in sorted(blocks + singles, key=lambda b: b["start"])
    ]  # fmt: skip
    return BatchLayout(p, lengths, tuple(out))
