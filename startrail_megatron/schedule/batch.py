"""Per-batch CP layouts: each document on a CP sub-group of its own size.

Note [per-batch CP layouts]
---------------------------
Real corpora are long-tailed: most documents are short, a few are long, and causal work
grows with the square of a document's length. One CP size for every document makes every
short document pay CP's communication, and one packed sequence per data-parallel replica
leaves the replicas unequal (their sums of squared lengths differ). A ``BatchLayout``
instead cuts the P ranks of the group (Megatron's DP x CP ranks, say) into aligned blocks:
a block of ``size`` k holds ranks ``[start, start + k)``, k divides P and ``start`` is a
multiple of k (so the blocks of one size are the same sub-groups in every batch and their
process groups are made once). Every rank is in exactly one block. Each document runs on
one block: the block's documents are packed (``pack_lengths`` for k ranks: each padded to
a multiple of 2k, zigzag-sharded per document over the block) and the block runs
StarTrail over its k ranks with its own team size C (C*C divides k; C = 1 is ring; a block
of one rank computes its documents alone, with no communication). Every document sees
exactly its own tokens (packed attention), so the result is the same as one device's, for
every layout; what a layout changes is which rank does which work and what it sends.

A rank's causal work is counted in (query, key) pairs: a document of n tokens has
n (n + 1) / 2, split evenly over its block's k ranks by the zigzag layout (up to one
diagonal term, ``blocks.py``'s Note [causal balance]). ``BatchLayout.rank_pairs`` gives each
rank's pairs and ``balance`` their max over mean. ``static_layout`` is the layout without
this: blocks of one CP size (the data-parallel replicas), documents dealt to them in order
by tokens. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layout import divisors, valid_team_sizes
from .packing import PackedLayout, pack_lengths

__all__ = [
    "BatchBlock",
    "BatchLayout",
    "doc_pairs",
    "document_bins",
    "first_fit_bin",
    "rank_doc_tokens",
    "rank_runs",
    "runs_from_rounds",
    "static_layout",
]


def doc_pairs(n: int) -> int:
    """Causal (query, key) pairs of a document of ``n`` tokens."""
    return n * (n + 1) // 2


def rank_doc_tokens(n: int, size: int) -> int:
    """Tokens one rank of a block of ``size`` holds of a document of ``n`` tokens: the
    document padded to a multiple of ``2 size`` (``pack_lengths``), zigzag-sharded."""
    return -(-n // (2 * size)) * 2


def first_fit_bin(held: Sequence[int], n: int, cap: int | None) -> int:
    """The first bin of ``held`` (the tokens per rank each holds) with room for ``n`` more
    within ``cap`` (None: any); ``len(held)`` where none has: a new bin."""
    return next((i for i, h in enumerate(held) if cap is None or h + n <= cap), len(held))


def document_bins(
    docs: Sequence[int], lengths: Sequence[int], size: int, cap: int | None
) -> list[list[int]]:
    """A block's documents ``docs`` (indices into ``lengths``) on ``size`` ranks in bins,
    each bin packed into one call: a bin's tokens per rank (``rank_doc_tokens`` of each of
    its documents) within ``cap`` (None: one bin). First fit, longest first (ties to the
    lower index), the order ``planner.batch``'s scheduler adds documents to a block in, so
    the calls it prices are these bins. The same on every rank (a function of the
    documents alone). ``ValueError`` where one document alone exceeds ``cap``. Pure."""
    bins: list[list[int]] = []
    held: list[int] = []
    for d in sorted(docs, key=lambda d: (-lengths[d], d)):
        n = rank_doc_tokens(lengths[d], size)
        if cap is not None and n > cap:
            raise ValueError(
                f"a document of {lengths[d]} tokens holds {n} per rank on {size} ranks: more "
                f"than the cap of {cap} tokens per rank in one call"
            )
        i = first_fit_bin(held, n, cap)
        if i == len(bins):
            bins.append([])
            held.append(0)
        bins[i].append(d)
        held[i] += n
    return bins


@dataclass(frozen=True)
class BatchBlock:
    """One sub-group of a ``BatchLayout``: ranks ``[start, start + size)``, StarTrail's team
    size ``team_size`` over them, and the batch's documents ``docs`` (indices) it runs."""

    start: int
    size: int
    team_size: int
    docs: tuple[int, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))


@dataclass(frozen=True)
class BatchLayout:
    """Which block (sub-group, team size) runs each document of one batch on ``cp_size``
    ranks (Note [per-batch CP layouts]). ``ValueError`` naming what is wrong where the
    blocks do not cut the ranks into aligned sub-groups, a team size does not fit its block,
    or a document is run by no block or by two."""

    cp_size: int
    lengths: tuple[int, ...]
    blocks: tuple[BatchBlock, ...]

    def __post_init__(self) -> None:
        p = self.cp_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"cp_size must be an integer >= 1, got {p!r}")
        object.__setattr__(self, "lengths", tuple(self.lengths))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in self.lengths):
            raise ValueError(f"lengths must be integers >= 0, got {list(self.lengths)}")
        owner: list[int | None] = [None] * p
        seen: dict[int, int] = {}
        for i, b in enumerate(self.blocks):
            if not (isinstance(b.size, int) and b.size >= 1 and p % b.size == 0):
                raise ValueError(
                    f"block {i}: size {b.size} must divide cp_size {p}; allowed: {divisors(p)}"
                )
            if not (isinstance(b.start, int) and b.start % b.size == 0 and 0 <= b.start < p):
                raise ValueError(
                    f"block {i}: start {b.start} must be a multiple of its size {b.size} "
                    f"below cp_size {p} (aligned sub-groups)"
                )
            if b.team_size not in valid_team_sizes(b.size):
                raise ValueError(
                    f"block {i}: team_size {b.team_size} does not fit its {b.size} ranks; "
                    f"allowed: {valid_team_sizes(b.size)}"
                )
            for r in b.ranks:
                if owner[r] is not None:
                    raise ValueError(f"rank {r} is in blocks {owner[r]} and {i}; one each")
                owner[r] = i
            for d in b.docs:
                if not 0 <= d < len(self.lengths):
                    raise ValueError(f"block {i}: document {d} is not in the batch")
                if d in seen:
                    raise ValueError(f"document {d} is in blocks {seen[d]} and {i}; one each")
                seen[d] = i
        missing = [r for r, o in enumerate(owner) if o is None]
        if missing:
            raise ValueError(f"ranks {missing} are in no block; every rank needs one")
        lost = [d for d in range(len(self.lengths)) if d not in seen]
        if lost:
            raise ValueError(f"documents {lost} are in no block; every document needs one")

    def block_of(self, rank: int) -> BatchBlock:
        """The block ``rank`` is in."""
        for b in self.blocks:
            if b.start <= rank < b.start + b.size:
                return b
        raise ValueError(f"rank {rank} is not below cp_size {self.cp_size}")

    def idle(self, block: BatchBlock) -> bool:
        """Whether ``block`` holds no token (no document, or documents of length 0 only):
        its ranks have no rows to attend, and send nothing."""
        return not any(self.lengths[d] for d in block.docs)

    def packed(self, block: BatchBlock) -> PackedLayout:
        """The packed layout of ``block``'s documents over its ranks (``pack_lengths``)."""
        return pack_lengths([self.lengths[d] for d in block.docs], block.size)

    def block_pairs(self, block: BatchBlock) -> int:
        """Causal pairs of ``block``'s documents, all its ranks together."""
        return sum(doc_pairs(self.lengths[d]) for d in block.docs)

    def rank_pairs(self) -> list[float]:
        """Each rank's causal pairs (its block's, split evenly over the block)."""
        out = [0.0] * self.cp_size
        for b in self.blocks:
            for r in b.ranks:
                out[r] = self.block_pairs(b) / b.size
        return out

    def rank_tokens(self) -> list[int]:
        """Each rank's tokens (its block's documents packed and padded, ``rank_doc_tokens``):
        what its activations, and the rest of the layer's work, grow with."""
        out = [0] * self.cp_size
        for b in self.blocks:
            for r in b.ranks:
                out[r] = sum(rank_doc_tokens(self.lengths[d], b.size) for d in b.docs)
        return out

    def balance(self) -> float:
        """Max over mean of ``rank_pairs`` (1.0: every rank does the same work)."""
        pairs = self.rank_pairs()
        mean = sum(pairs) / len(pairs)
        return max(pairs) / mean if mean else 1.0

    def fingerprint(self) -> int:
        """A 31-bit digest of the layout (ranks compare it before any transfer)."""
        h = self.cp_size
        for x in (*self.lengths, -1, *(v for b in self.blocks for v in
                  (b.start, b.size, b.team_size, *b.docs, -2))):  # fmt: skip
            h = (h * 1_000_003 + x + 7) % 2_147_483_647
        return h


def static_layout(
    lengths: Sequence[int], cp_size: int, group_size: int, team_size: int = 1
) -> BatchLayout:
    """The layout without per-batch sub-groups: ``cp_size / group_size`` blocks of
    ``group_size`` ranks (the data-parallel replicas of one CP size), each running StarTrail
    with ``team_size``; the documents dealt in order, each to the replica with the fewest
    tokens so far (a token-balanced split, as a packed data loader fills its rows)."""
    if group_size < 1 or cp_size % group_size:
        raise ValueError(f"group_size {group_size} must divide cp_size {cp_size}")
    n = cp_size // group_size
    docs: list[list[int]] = [[] for _ in range(n)]
    tokens = [0] * n
    for d, length in enumerate(lengths):
        i = min(range(n), key=lambda j: (tokens[j], j))
        docs[i].append(d)
        tokens[i] += length
    blocks = [BatchBlock(i * group_size, group_size, team_size, tuple(docs[i])) for i in range(n)]
    return BatchLayout(cp_size, tuple(lengths), tuple(blocks))


def rank_runs(placed: list[tuple[int, int, int]], rank: int) -> list[tuple[int, int, int]]:
    """``rank``'s runs among ``placed`` (``(document, size, start)``: the document on ranks
    ``[start, start + size)``), in the order every rank runs its own: larger sub-groups
    first, then by document. The order is one total order over all runs, so each
    sub-group's ranks reach their shared runs in the same sequence and no two sub-groups
    wait on each other. Pure."""
    mine = [r for r in placed if r[2] <= rank < r[2] + r[1]]
    return sorted(mine, key=lambda r: (-r[1], r[0]))


def runs_from_rounds(rounds, sizes=None) -> list[tuple[int, int, int]]:
    """megatron-core's ``BalancedCPScheduler`` rounds (each a list, per rank, of the
    document ids it holds) as runs ``(document, size, start)``: a document on the ranks of
    its round that hold it. ``ValueError`` where those ranks are not an aligned block (of a
    size in ``sizes``, where given): megatron-core has no group for them. Pure."""
    runs = []
    for rnd in rounds:
        holders: dict[int, list[int]] = {}
        for r, ids in enumerate(rnd):
            for d in ids:
                holders.setdefault(int(d), []).append(r)
        for d, ranks in holders.items():
            k, start = len(ranks), ranks[0]
            if start % k or ranks != list(range(start, start + k)) or (sizes and k not in sizes):
                raise ValueError(
                    f"megatron-core's BalancedCPScheduler put document {d} on ranks {ranks}, "
                    "which are not one of the sub-groups"
                    + (f" (aligned blocks of {sorted(sizes)})" if sizes else " (aligned blocks)")
                )
            runs.append((d, k, start))
    return runs
