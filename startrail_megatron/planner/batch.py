"""The per-batch scheduler: from a batch's document lengths, the ``BatchLayout`` (which
sub-group and team size runs each document, ``schedule/batch.py``'s Note [per-batch CP
layouts]) whose slowest rank the cost model predicts shortest.

Prices, from the planner's own model (``cluster``: a ``ClusterSpec``):
- a rank's kernels: its causal pairs at the cluster's attention rate, forward and
  backward (``compute.kernel_time``'s FLOP count), and its block's calls at the cluster's
  ``kernel_overhead`` each (as many as the strategy model makes for the block's size and
  team size; a rank alone packs its documents into one call each way, and so does a
  multi-rank block unless ``binned``: then its documents run in bins within the cap,
  ``schedule.batch.document_bins``, one call each, as our entry point runs them);
- a block's communication: the planner's own time for StarTrail's transfers on k ranks
  with team size C (``strategies``: team collectives and sub-ring steps over the links
  they cross, the ``team`` placement, the block inside a node where it fits one) with
  instant kernels, per local token (linear in the tokens each rank holds); a block of one
  rank sends nothing. Each block size takes the team size with the fewest predicted
  seconds per token;
- with a ``model``: the rest of the layer, its dense GEMMs (``prediction.
  dense_token_seconds``) per token the rank holds. Attention alone grows with the square
  of a document's length, the layer's GEMMs with its tokens: a layout that balances causal
  pairs alone piles short documents' tokens on some ranks (1.2x the mean on Megatron's
  lognormal lengths), slower than the static layout for a 7B model's layer.
A rank's time is its kernels and its block's communication, the longer of the two where
the cluster overlaps transfers with compute (``ClusterSpec.overlap``), else their sum, then
its GEMMs. ``max_tokens_per_rank`` caps the tokens a rank holds in one call (memory).

The search (greedy, O(documents x blocks)):
1. target = every rank's share of the batch's work. A document whose time alone exceeds
   it (or whose tokens do not fit the cap on one rank) gets a block of its own: the
   smallest size k dividing P whose per-rank time (its kernels / k + its communication)
   is within the target (none: the size with the least) and whose share fits the cap,
   placed at the lowest aligned free start (longest documents first; where no aligned
   place is left, it joins the multi-rank block with the least time per rank and room).
2. The ranks left over are blocks of one.
3. The other documents, longest first, each go where the slowest rank's time grows least:
   onto the least loaded block of one with room, or into a multi-rank block (packed with
   its documents, sharded over its ranks).
The search runs twice where the ranks span nodes: with every block size, and with
blocks no wider than a node (a long document then takes a node's ranks, more work per rank
but no transfer over a node link). Of these layouts and the static one (every document on
all P ranks, the best C), the one within the cap whose slowest rank the model predicts
fastest is returned: never predicted slower than the static layout. Pure: no torch.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Mapping, Sequence

from ..schedule.batch import (
    BatchBlock,
    BatchLayout,
    doc_pairs,
    document_bins,
    first_fit_bin,
    rank_doc_tokens,
)
from ..schedule.layout import divisors, valid_team_sizes
from .cluster import CLUSTER_PRESETS, ClusterSpec, ModelSpec
from .prediction import dense_token_seconds
from .shape import AttnShape

__all__ = ["BatchPrices", "schedule_batch"]

_REF_TOKENS = 1024  # tokens per rank at which a block's bytes per token are read


class BatchPrices:
    """Seconds per causal pair (kernels, forward + backward), per token of the rest of the
    layer (``model``'s dense GEMMs over ``tp_size`` ranks; 0 without a model) and, per block
    size, the team size, the seconds and bytes per local token of its communication and
    its kernel calls' fixed seconds, on ``cluster`` for one call shape (heads, head size,
    element bytes). ``binned``: a multi-rank block's documents run in bins, each within
    ``max_tokens_per_rank`` per rank (``schedule.batch.document_bins``), one call each (our
    entry point's hybrid schedule), not packed into one; a rank alone packs them either
    way."""

    def __init__(
        self,
        cluster: ClusterSpec,
        heads_q: int,
        heads_kv: int,
        head_dim: int,
        elem_bytes: int = 2,
        batch: int = 1,
        team_sizes: Mapping[int, int] | None = None,
        model: ModelSpec | None = None,
        recompute: bool = False,
        tp_size: int = 1,
        binned: bool = False,
        max_tokens_per_rank: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.fixed = dict(team_sizes or {})
        self.dims = (heads_q, heads_kv, head_dim, elem_bytes, batch)
        flops_per_pair = 4 * head_dim * heads_q * batch
        self.pair_s = flops_per_pair / cluster.attn_flops * (1 + cluster.attn_bwd_ratio)
        dense = dense_token_seconds(cluster, model, recompute) if model else 0.0
        self.token_s = dense * batch / tp_size  # the GEMMs split over tensor parallelism
        self._prices: dict[tuple[int, int], tuple[float, float, float]] = {}
        self.binned, self.cap = binned, max_tokens_per_rank

    def _block(self, size: int, team_size: int) -> tuple[float, float, float]:
        key = (size, team_size)  # cached here too: the search asks at every placement
        if key not in self._prices:
            self._prices[key] = _block_model(self.cluster, self.dims, size, team_size)
        return self._prices[key]

    def block_price(self, size: int, team_size: int) -> tuple[float, float]:
        """(communication seconds, bytes sent) per local token of a block of ``size`` ranks
        with ``team_size`` (max over its ranks; 0 for one rank)."""
        return self._block(size, team_size)[:2]

    def team_size(self, size: int) -> int:
        """The team size of a block of ``size`` with the fewest seconds per token (or the
        one ``team_sizes`` fixed for that size)."""
        if size not in self.fixed:  # cached there: the search asks at every placement
            self.fixed[size] = min(
                valid_team_sizes(size), key=lambda c: (self.block_price(size, c)[0], c)
            )
        return self.fixed[size]

    def block_calls(self, size: int, team_size: int) -> float:
        """Seconds of a block's kernel calls' fixed cost on each of its ranks (the planner's
        ``kernel_overhead`` per call, as many calls as its strategy model makes: one call
        forward and one backward for a rank alone, whatever it packs)."""
        return self._block(size, team_size)[2]

    def rank_seconds(
        self, size: int, team_size: int, pairs: float, tokens: int, runs: int = 1
    ) -> float:
        """One rank's predicted seconds in a block of ``size`` holding ``pairs`` causal
        pairs and ``tokens`` tokens in ``runs`` packed calls each way (a multi-rank block's
        bins; a rank alone makes one): its kernels (their FLOPs and their calls' fixed
        cost) and its share of the transfers (the longer of the two where the cluster
        overlaps them, else their sum), then its tokens' share of the rest of the layer."""
        comm_per_token, _, calls = self._block(size, team_size)
        runs = (runs if size > 1 else 1) if pairs else 0
        comp = pairs * self.pair_s / size + runs * calls
        comm = comm_per_token * tokens / size
        attn = max(comp, comm) if self.cluster.overlap else comp + comm
        return attn + self.token_s * tokens / size

    def layout_seconds(self, layout: BatchLayout) -> list[float]:
        """Each rank's predicted seconds under ``layout``."""
        out = [0.0] * layout.cp_size
        for b in layout.blocks:
            tokens = sum(layout.lengths[d] for d in b.docs)
            t = self.rank_seconds(
                b.size, b.team_size, layout.block_pairs(b), tokens, self.block_runs(layout, b)
            )
            for r in b.ranks:
                out[r] = t
        return out

    def block_runs(self, layout: BatchLayout, b: BatchBlock) -> int:
        """The packed calls each way of block ``b``: its bins where ``binned``, else one."""
        if not self.binned or b.size == 1:
            return 1
        return len(document_bins(b.docs, layout.lengths, b.size, self.cap))

    def layout_balance(self, layout: BatchLayout) -> float:
        """Max over mean of ``layout_seconds``: the balance of the ranks' predicted time
        (``BatchLayout.balance`` is their causal pairs', which a block's calls and
        transfers, and the layer's tokens, move away from it)."""
        t = self.layout_seconds(layout)
        mean = sum(t) / len(t)
        return max(t) / mean if mean else 1.0

    def layout_bytes(self, layout: BatchLayout) -> list[float]:
        """Each rank's bytes sent under ``layout`` (the model's)."""
        out = [0.0] * layout.cp_size
        for b in layout.blocks:
            tokens = sum(layout.lengths[d] for d in b.docs)
            for r in b.ranks:
                out[r] = self.block_price(b.size, b.team_size)[1] * tokens / b.size
        return out


@functools.lru_cache(maxsize=4096)
def _block_model(cluster: ClusterSpec, dims: tuple, size: int, team_size: int):
    """(transfer seconds, bytes sent) per local token of a block and its kernel calls' fixed
    seconds per rank, forward and backward, from the planner's own strategy model
    (``strategies.Strategy.spec.times``: team collectives and sub-ring steps over the links
    they cross, ``team`` placement, the block at an aligned start: inside a node where it
    fits one) with instant kernels: without their per-call cost only the transfers are
    left, with instant transfers too only ``kernel_overhead`` times the calls (independent
    of the tokens). A block of one rank sends nothing. Cached: the same cluster and call
    shape price the same in every batch."""
    from .strategies import Strategy, comm_bytes

    hq, hkv, d, e, b = dims
    shape = AttnShape(size, _REF_TOKENS, b, hq, hkv, d, elem_bytes=e, acc_bytes=4)
    per_node = min(cluster.gpus_per_node, size)
    instant = cluster.with_(
        gpus_per_node=per_node, num_nodes=-(-size // per_node), attn_flops=1e30,
        matmul_flops=1e30, mem_bw=0.0,
    )  # fmt: skip
    st = Strategy("startrail", team_size, "team")
    calls_only = instant.with_(
        intra_bw=1e30, inter_bw=1e30, inter_bw_per_gpu=1e30, intra_latency=0.0,
        inter_latency=0.0, host_cores=0, all_to_all_inter_bw=0.0,
    )  # fmt: skip
    calls = sum(st.spec.times(st, calls_only, shape))
    if size == 1:
        return 0.0, 0.0, calls
    transfers = sum(st.spec.times(st, instant.with_(kernel_overhead=0.0), shape))
    sent = max(sum(r.values()) for r in comm_bytes(st, shape))
    return transfers / _REF_TOKENS, sent / _REF_TOKENS, calls


def schedule_batch(
    lengths: Sequence[int],
    cp_size: int,
    *,
    heads_q: int = 32,
    heads_kv: int = 8,
    head_dim: int = 128,
    elem_bytes: int = 2,
    cluster: ClusterSpec | None = None,
    sizes: Sequence[int] | None = None,
    team_sizes: Mapping[int, int] | None = None,
    model: ModelSpec | None = None,
    recompute: bool = False,
    tp_size: int = 1,
    max_tokens_per_rank: int | None = None,
    binned: bool = False,
) -> BatchLayout:
    """The batch's layout on ``cp_size`` ranks (module docstring), priced on ``cluster``
    (default: the ``h100-ib`` preset, its nodes holding ``min(cp_size, 8)`` ranks).
    ``sizes``: the block sizes there are process groups for (default: every divisor of
    ``cp_size``; 1 and ``cp_size`` are always allowed); ``team_sizes``: a fixed team size
    per block size (default: the cheapest on the model). ``model`` (``recompute``,
    ``tp_size``): the layer around the attention call, whose dense GEMMs cost each rank per
    token it holds (without it the layout balances attention alone).
    ``max_tokens_per_rank``: the most tokens a rank may hold (``rank_doc_tokens``, padding
    included) in one call, its block's documents together or, with ``binned`` (our entry
    point's hybrid schedule: a block's documents in bins within the cap,
    ``schedule.batch.document_bins``, one call each), each document alone; the bins'
    calls are priced. ``ValueError`` naming the setting where a size does not divide
    ``cp_size``, a team size does not fit its size, or no layout keeps to the cap."""
    p = cp_size
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {p!r}")
    allowed = divisors(p)
    sizes = allowed if sizes is None else sorted({1, p, *sizes})
    bad = [k for k in sizes if k not in allowed]
    if bad:
        raise ValueError(f"sizes {bad} do not divide cp_size {p}; allowed: {allowed}")
    for k, c in (team_sizes or {}).items():
        if k not in sizes or c not in valid_team_sizes(k):
            raise ValueError(
                f"team_sizes {{{k}: {c}}}: a block size in {sizes} and a team size in "
                f"{valid_team_sizes(k) if k in allowed else '(none)'}"
            )
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    cap = max_tokens_per_rank
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 2):
        raise ValueError(f"max_tokens_per_rank must be an integer >= 2 or None, got {cap!r}")
    lengths = tuple(lengths)
    if cluster is None:
        cluster = CLUSTER_PRESETS["h100-ib"].with_(gpus_per_node=min(p, 8))
    prices = BatchPrices(
        cluster, heads_q, heads_kv, head_dim, elem_bytes, team_sizes=team_sizes, model=model,
        recompute=recompute, tp_size=tp_size, binned=binned, max_tokens_per_rank=cap,
    )  # fmt: skip
    room = _Room(cap, binned)
    candidates = []
    if room.fits(room.add(0, lengths, p)):
        candidates.append(BatchLayout(
            p, lengths, (BatchBlock(0, p, prices.team_size(p), tuple(range(len(lengths)))),)
        ))  # fmt: skip
    candidates.append(_greedy(lengths, p, prices, sizes, room))
    node = cluster.gpus_per_node
    inside = [k for k in sizes if k <= node]
    if node < p and inside != sizes:  # no block wider than a node: its links stay inside
        candidates.append(_greedy(lengths, p, prices, inside, room))
    candidates = [c for c in candidates if c is not None]
    if not candidates:
        raise ValueError(
            f"max_tokens_per_rank {cap}: no layout of {len(lengths)} documents ({sum(lengths)} "
            f"tokens, longest {max(lengths, default=0)}) on {p} ranks keeps every rank within "
            f"it{'' if binned else ' (a block packs its documents in one call)'}"
            "; raise it or shorten the batch"
        )
    return min(candidates, key=lambda lay: max(prices.layout_seconds(lay)))


class _Room:
    """The cap on a rank's tokens in one call (``schedule_batch``'s ``max_tokens_per_rank``):
    what a rank holds grows by a document's share as the sum of its block's documents (one
    packed call) or their largest (in bins: a document fits if it fits a bin of its own)."""

    def __init__(self, cap: int | None, binned: bool) -> None:
        self.cap, self.per_document = cap, binned

    def add(self, held: int, lengths, size: int) -> int:
        if self.cap is None:  # nothing to keep: not counted
            return 0
        shares = [rank_doc_tokens(n, size) for n in lengths]
        return max([held, *shares]) if self.per_document else held + sum(shares)

    def fits(self, held: int) -> bool:
        return self.cap is None or held <= self.cap


def _greedy(
    lengths: tuple, p: int, prices: BatchPrices, sizes: list[int], room: _Room
) -> BatchLayout | None:
    """The module docstring's search, over blocks of ``sizes``; ``None`` where it finds no
    room within the cap for a document."""
    pairs = [doc_pairs(n) for n in lengths]
    call1 = prices.block_calls(1, 1)  # a rank alone: its documents packed in one call
    work = [prices.rank_seconds(1, 1, pairs[d], n) - call1 for d, n in enumerate(lengths)]
    target = sum(work) / p  # every rank's share of the batch's work, transfers aside

    def grown(t: float, d: int) -> float:  # a rank alone at t seconds, given document d
        return t + work[d] + (0.0 if t else call1)

    def per_rank(b: dict, d: int | None = None) -> float:
        # transfers in flight beside the kernels where the cluster overlaps them (the
        # sub-ring steps hide their K,V behind the previous step's calls), else after them
        extra_pairs, extra_tokens = (0, 0) if d is None else (pairs[d], lengths[d])
        k = b["size"]
        return prices.rank_seconds(
            k, prices.team_size(k), b["pairs"] + extra_pairs, b["tokens"] + extra_tokens,
            len(b["bins"]) + (d is not None and first_bin(b, d) == len(b["bins"])),
        )  # fmt: skip

    def block(start: int, size: int) -> dict:
        return dict(start=start, size=size, docs=[], pairs=0, tokens=0, held=0, bins=[])

    def first_bin(b: dict, d: int) -> int:
        # documents reach a block longest first: first fit here is document_bins' packing
        if not prices.binned:
            return 0
        return first_fit_bin(b["bins"], rank_doc_tokens(lengths[d], b["size"]), prices.cap)

    def put(b: dict, d: int) -> None:
        i = first_bin(b, d)
        if i == len(b["bins"]):
            b["bins"].append(0)
        b["bins"][i] += rank_doc_tokens(lengths[d], b["size"])
        b["docs"].append(d)
        b["pairs"] += pairs[d]
        b["tokens"] += lengths[d]
        b["held"] = room.add(b["held"], (lengths[d],), b["size"])

    def fits(b: dict, d: int) -> bool:
        return room.fits(room.add(b["held"], (lengths[d],), b["size"]))

    order = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    free = [True] * p
    blocks: list[dict] = []  # multi-rank blocks (and one-rank blocks of a capped document)
    small: list[int] = []
    for d in order:
        if p == 1 or (work[d] <= target and room.fits(room.add(0, (lengths[d],), 1))):
            small.append(d)
            continue
        ok = [k for k in sizes if room.fits(room.add(0, (lengths[d],), k))]
        if not ok:
            return None
        fast = [k for k in ok if per_rank(block(0, k), d) <= target] or [
            min(ok, key=lambda k: per_rank(block(0, k), d))
        ]
        placed = False
        for k in (k for k in ok if k >= fast[0]):
            start = next((s for s in range(0, p, k) if all(free[s : s + k])), None)
            if start is not None:
                for r in range(start, start + k):
                    free[r] = False
                blocks.append(block(start, k))
                put(blocks[-1], d)
                placed = True
                break
        if not placed:  # no aligned room left: the least loaded block with room takes it
            roomy = [b for b in blocks if fits(b, d)]
            if not roomy:
                return None
            put(min(roomy, key=lambda b: per_rank(b, d)), d)
    singles = [block(r, 1) for r in range(p) if free[r]]
    heap = [(0.0, i) for i in range(len(singles))]
    for d in small:
        options = []
        skipped = []
        while heap:  # the least loaded single with room for it
            t, i = heapq.heappop(heap)
            skipped.append((t, i))
            if fits(singles[i], d):  # a rank alone sends nothing: its time adds up
                options.append((grown(t, d), 0, i))
                break
        for j, b in enumerate(blocks):
            if fits(b, d):
                options.append((per_rank(b, d), 1, j))
        if not options:
            return None
        _, kind, i = min(options)
        target_block = singles[i] if kind == 0 else blocks[i]
        put(target_block, d)
        for t, j in skipped:
            heapq.heappush(heap, (grown(t, d) if j == i and kind == 0 else t, j))
    out = [
        BatchBlock(b["start"], b["size"], prices.team_size(b["size"]),
                   tuple(sorted(b["docs"])))
        for b in sorted(blocks + singles, key=lambda b: b["start"])
    ]  # fmt: skip
    return BatchLayout(p, lengths, tuple(out))
