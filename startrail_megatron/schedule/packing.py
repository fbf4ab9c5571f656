"""Packed documents: the per-document zigzag layout, pure ints (no torch).

A packed sequence holds several documents one after another. Each document of
real length ``n_d`` is padded to ``L_d``, a multiple of ``2P`` (Megatron/TE's
``cu_seqlens_padded``), and sharded by Megatron's per-document zigzag: CP rank
``r`` holds chunks ``r`` and ``2P-1-r`` of every document (``L_d / 2P`` tokens
each), exactly what ``megatron.core.utils.get_batch_on_this_cp_rank`` gives for
THD with per-document balancing. A rank's local buffer is, per document in
order, its two chunks; padding sits at the end of each document.

Note [packed documents under StarTrail]
---------------------------------------
After the team all-gather and a per-document reorder, a team's buffer holds,
per document, its 2C chunks in ascending chunk order: for team t (team
placement) chunks [tC, tC+C) and [2P-C-tC, 2P-tC), i.e. exactly Megatron's
zigzag split of the document over T = P/C "ranks". Every team's buffer has the
same document offsets (``team_offset``), so K,V travel with no metadata, and
each (Q team, KV team) block is, per document, ``schedule.plan_block`` on the
two teams' chunk ids scaled by the document's chunk length: own team causal
over all rows, earlier team all rows against the KV fronts, later team the Q
backs against all KV (the three cases of TransformerEngine's P2P attention).
Since a team's chunks of a document are in ascending position order, its real
tokens are a prefix of its part of the buffer (``real_in_team``): clipping every
call to the real prefixes keeps padding rows out of every call (zero output,
zero gradients) and padding keys out of every softmax. A document of length 0
has no rows at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["PackedLayout", "lengths_from_position_ids", "pack_lengths"]


def _as_ints(name: str, xs) -> tuple[int, ...]:
    """A 1-D sequence of ints (list, tuple, or a 1-D integer tensor's ``tolist()``)."""
    if hasattr(xs, "tolist") and not isinstance(xs, (list, tuple)):
        if getattr(xs, "dim", lambda: 1)() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(xs.shape)}")
        if getattr(xs, "is_floating_point", lambda: False)():
            raise ValueError(f"{name} must hold integers, got {xs.dtype}")
        xs = xs.tolist()
    out = []
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{name} must hold integers, got {x!r}")
        out.append(x)
    return tuple(out)


def _check_boundaries(name: str, cu: tuple[int, ...]) -> None:
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold at least one document, got {list(cu)}")
    bad = [i for i in range(1, len(cu)) if cu[i] < cu[i - 1]]
    if bad:
        i = bad[0]
        raise ValueError(
            f"{name} must not decrease: entry {i} ({cu[i]}) < entry {i - 1} ({cu[i - 1]})"
        )


@dataclass(frozen=True)
class PackedLayout:
    """The documents of one packed sequence and their per-document zigzag layout.

    Args:
        cp_size: P.
        cu_seqlens: real document boundaries, ``[0, n_0, n_0 + n_1, ...]`` (the global,
            unpadded ``cu_seqlens_q`` of Megatron's ``PackedSeqParams``).
        cu_seqlens_padded: padded boundaries (``cu_seqlens_q_padded``): every padded
            length a multiple of 2P and at least the real one.
    """

    cp_size: int
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]

    def __post_init__(self) -> None:
        p = self.cp_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"cp_size must be an integer >= 1, got {p!r}")
        _check_boundaries("cu_seqlens", self.cu_seqlens)
        _check_boundaries("cu_seqlens_padded", self.cu_seqlens_padded)
        if len(self.cu_seqlens) != len(self.cu_seqlens_padded):
            raise ValueError(
                f"cu_seqlens ({len(self.cu_seqlens) - 1} documents) and cu_seqlens_padded "
                f"({len(self.cu_seqlens_padded) - 1} documents) must describe the same documents"
            )
        for d, (n, pad) in enumerate(zip(self.lengths, self.padded_lengths)):
            if pad % (2 * p):
                raise ValueError(
                    f"cu_seqlens_padded: document {d} is padded to {pad} tokens, not a multiple of "
                    f"2 * cp_size = {2 * p} (per-document zigzag); pack_lengths() makes the layout"
                )
            if n > pad:
                raise ValueError(
                    f"cu_seqlens: document {d} has {n} real tokens but only {pad} padded ones "
                    "in cu_seqlens_padded"
                )

    @classmethod
    def create(cls, cp_size: int, cu_seqlens, cu_seqlens_padded=None) -> PackedLayout:
        """From boundaries given as lists or 1-D integer tensors (``ValueError`` naming the
        argument otherwise); ``cu_seqlens_padded`` defaults to ``cu_seqlens`` (no padding)."""
        cu = _as_ints("cu_seqlens", cu_seqlens)
        padded = (
            cu if cu_seqlens_padded is None else _as_ints("cu_seqlens_padded", cu_seqlens_padded)
        )
        return cls(cp_size, cu, padded)

    # ---- sizes ---------------------------------------------------------------------
    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        cu = self.cu_seqlens
        return tuple(cu[i + 1] - cu[i] for i in range(len(cu) - 1))

    @cached_property
    def padded_lengths(self) -> tuple[int, ...]:
        cu = self.cu_seqlens_padded
        return tuple(cu[i + 1] - cu[i] for i in range(len(cu) - 1))

    @property
    def total(self) -> int:
        """The padded sequence length, S = P * s_local."""
        return self.cu_seqlens_padded[-1]

    @property
    def s_local(self) -> int:
        return self.total // self.cp_size

    def chunk_len(self, doc: int) -> int:
        """Tokens in one of document ``doc``'s 2P zigzag chunks."""
        return self.padded_lengths[doc] // (2 * self.cp_size)

    @cached_property
    def local_offsets(self) -> tuple[int, ...]:
        """Where each document starts in a rank's local buffer (its 2 chunks per document)."""
        out, at = [], 0
        for pad in self.padded_lengths:
            out.append(at)
            at += pad // self.cp_size
        return tuple(out)

    def real_in_chunks(self, doc: int, chunk_ids: Sequence[int]) -> int:
        """Real tokens of document ``doc`` in its chunks ``chunk_ids`` (padding at the end)."""
        c, n = self.chunk_len(doc), self.lengths[doc]
        return sum(min(max(n - j * c, 0), c) for j in chunk_ids)

    def local_rows(self, cp_rank: int) -> list[tuple[int, int, int]]:
        """(row in the unpadded concatenation of the documents, local row, tokens) of each
        run of real tokens ``cp_rank`` holds: what sharding and unsharding copy."""
        p, out = self.cp_size, []
        for d in range(self.num_docs):
            c, start, local = self.chunk_len(d), self.cu_seqlens[d], self.local_offsets[d]
            for half, j in enumerate((cp_rank, 2 * p - 1 - cp_rank)):
                real = self.real_in_chunks(d, [j])
                if real:
                    out.append((start + j * c, local + half * c, real))
        return out

    def real_rows(self, cp_rank: int) -> tuple[int, ...]:
        """``cp_rank``'s local rows that hold real tokens (not padding), ascending."""
        return tuple(dst + i for _, dst, n in self.local_rows(cp_rank) for i in range(n))

    def fingerprint(self) -> int:
        """A 31-bit digest of both boundary lists (ranks compare it before any transfer)."""
        h = 0
        for x in (*self.cu_seqlens, -1, *self.cu_seqlens_padded):
            h = (h * 1_000_003 + x + 7) % 2_147_483_647
        return h


def pack_lengths(lengths: Sequence[int], cp_size: int) -> PackedLayout:
    """The layout of documents of any lengths (0 and 1 included): each padded to the next
    multiple of 2P (at least 0)."""
    ls = _as_ints("lengths", lengths)
    if any(n < 0 for n in ls):
        raise ValueError(f"lengths must be >= 0, got {list(ls)}")
    step = 2 * cp_size
    cu, padded = [0], [0]
    for n in ls:
        cu.append(cu[-1] + n)
        padded.append(padded[-1] + -(-n // step) * step)
    return PackedLayout(cp_size, tuple(cu), tuple(padded))


def lengths_from_position_ids(position_ids: Sequence[int]) -> list[int]:
    """Document lengths of one packed row whose position ids restart at 0 per document
    (transformers' ``DataCollatorWithFlattening``): ``[0, 1, 2, 0, 1]`` -> ``[3, 2]``.

    ``ValueError`` unless the row starts at 0 and every document's ids step by one.
    """
    pos = _as_ints("position_ids", position_ids)
    if not pos or pos[0] != 0:
        raise ValueError(
            "position_ids of a packed row must start at 0 and restart at 0 for every document"
        )
    lengths: list[int] = []
    for i, x in enumerate(pos):
        if x == 0:
            lengths.append(1)
        elif x == pos[i - 1] + 1:
            lengths[-1] += 1
        else:
            raise ValueError(
                f"position_ids[{i}] = {x} after {pos[i - 1]}: a packed row's position ids must "
                "step by one inside a document and restart at 0 for the next"
            )
    return lengths
