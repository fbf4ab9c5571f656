"""StarTrail x Ulysses: one CP group split into head-parallel all-to-all and StarTrail.

Note [the 2-D split]
~~~~~~~~~~~~~~~~~~~~
A CP group of P = U x R ranks. CP rank ``p = r*U + u`` (``u`` varies fastest):

  * its Ulysses group is the U consecutive CP ranks ``r*U .. r*U + U-1`` (the fast links
    of one node, when U ranks share a node: Megatron's ``a2a+p2p`` puts its all-to-all on
    consecutive ranks the same way);
  * its ring group is the R CP ranks ``u, U + u, 2U + u, ...``: StarTrail (team size C,
    C*C dividing R, either placement) runs over them as over a CP group of R ranks.

    P = 8, U = 2, R = 4, C = 2 ("team" placement over the ring group):

      CP rank      0   1   2   3   4   5   6   7
      Ulysses     [0   1] [2   3] [4   5] [6   7]      all-to-all inside each pair
      ring u=0     0       2       4       6           StarTrail over 4 ranks (teams {0,2}
      ring u=1         1       3       5       7       and {4,6}; {1,3} and {5,7})

The forward: an all-to-all in each Ulysses group turns ``[s, b, h, d]`` (this rank's
sequence shard, every head) into ``[U*s, b, h/U, d]`` (the Ulysses group's tokens, the
query heads ``u*h/U .. (u+1)*h/U - 1``); StarTrail runs over the ring group on that; the
inverse all-to-all returns the output to ``[s, b, h, d]``. The backward mirrors it (the
gradient of an all-to-all is the inverse all-to-all).

Causal balance is kept. Before the all-to-all, CP rank p holds Megatron's zigzag chunks
p and 2P-1-p of 2P (per document, packed). The Ulysses group of ring rank r then holds
chunks rU .. rU+U-1 and 2P-U(r+1) .. 2P-1-rU: one block of U chunks at each end, i.e.
chunks r and 2R-1-r of the sequence cut into 2R, R's own zigzag layout. So after the
all-to-all the U received shards are put in sequence order: the front halves in member
order, then the back halves in reverse member order (``ring_segments``; per document for
packed documents). StarTrail then sees an ordinary zigzag shard of a CP group of R ranks.

GQA: k and v are sharded by heads like q when U divides ``heads_kv``; when ``heads_kv``
divides U instead, each KV head is repeated U / heads_kv times before the all-to-all (as
Megatron does), so every member gets the one KV head its query heads read; the repeated
copies are sent (U - 1)/U of ``U/heads_kv`` times the K,V bytes, and their gradients sum
back. Either way U must divide ``heads_q``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .layout import Placement, StarTrailLayout, divisors

__all__ = ["UlyssesLayout", "kv_repeat", "ring_segments"]


@dataclass(frozen=True)
class UlyssesLayout:
    """Where every CP rank sits in the 2-D split (Note [the 2-D split]).

    Args:
        cp_size: P, the ranks of the CP group.
        ulysses_size: U, the ranks of each head-parallel all-to-all group; U divides P.
        team_size: C, StarTrail's team size over the R = P / U ranks of each ring group;
            C*C must divide R.
        placement: StarTrail's placement over the ring group (``"team"``, ``"ring"`` or a
            map of the R ring ranks: ``StarTrailLayout``).
    """

    cp_size: int
    ulysses_size: int
    team_size: int
    placement: Placement = "team"

    def __post_init__(self) -> None:
        if isinstance(self.placement, list):  # a map: hashable, as the layout keeps it
            object.__setattr__(self, "placement", tuple(self.placement))
        p, u = self.cp_size, self.ulysses_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"context-parallel size must be an integer >= 1, got {p!r}")
        if not isinstance(u, int) or isinstance(u, bool) or u < 1 or p % u != 0:
            allowed = divisors(p)
            raise ValueError(
                f"ulysses_size={u!r} does not fit context-parallel size {p}: it must divide it; "
                f"allowed: {allowed}"
            )
        try:
            self.ring  # noqa: B018 - builds and checks StarTrail's layout over R ranks
        except ValueError as e:
            raise ValueError(
                f"ulysses_size={u} leaves R = {p // u} ranks per ring group for StarTrail: {e}"
            ) from None

    @property
    def ring_size(self) -> int:
        """R = P / U: the ranks of one ring group (StarTrail's CP size)."""
        return self.cp_size // self.ulysses_size

    @cached_property
    def ring(self) -> StarTrailLayout:
        """StarTrail's layout over one ring group (CP size R)."""
        return StarTrailLayout(self.ring_size, self.team_size, self.placement)

    def coord(self, cp_rank: int) -> tuple[int, int]:
        """``(ring_rank, ulysses_rank)`` of a CP rank: ``divmod(cp_rank, U)``."""
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {cp_rank} is outside 0 .. {self.cp_size - 1}")
        return divmod(cp_rank, self.ulysses_size)

    def ulysses_ranks(self, ring_rank: int) -> list[int]:
        """The CP ranks of ring rank ``ring_rank``'s Ulysses group, in member order."""
        u = self.ulysses_size
        return list(range(ring_rank * u, (ring_rank + 1) * u))

    def ring_ranks(self, ulysses_rank: int) -> list[int]:
        """The CP ranks of the ring group of Ulysses member ``ulysses_rank``, ring order."""
        return list(range(ulysses_rank, self.cp_size, self.ulysses_size))


def kv_repeat(ulysses_size: int, heads_q: int, heads_kv: int) -> int:
    """How often each KV head is repeated before the all-to-all (1: none).

    ``ValueError`` naming both counts unless U divides ``heads_q`` and U divides
    ``heads_kv`` or ``heads_kv`` divides U (Note [the 2-D split], GQA).
    """
    u = ulysses_size
    if heads_q % u != 0:
        raise ValueError(
            f"ulysses_size={u} must divide the query heads ({heads_q}): Ulysses shards heads"
        )
    if heads_kv % u == 0:
        return 1
    if u % heads_kv == 0:
        return u // heads_kv
    raise ValueError(
        f"ulysses_size={u} and the key/value heads ({heads_kv}): one must divide the other "
        "(KV heads are sharded when U divides them, repeated when they divide U)"
    )


def ring_segments(ulysses_size: int, doc_lengths: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """Rows of the received ``[U * s_local]`` buffer (member u's shard at ``u * s_local``),
    as ``(start, length)`` runs in the order StarTrail's ring rank holds them.

    ``doc_lengths``: this rank's local rows per document (each even: chunk ``p`` then chunk
    ``2P-1-p`` of the document), one entry ``(s_local,)`` for a plain zigzag sequence, or
    ``None`` where the token order does not matter (full attention without window or
    documents): ``[]``, the buffer as received. Per document: every member's front half in member
    order, then every member's back half in reverse member order (Note [the 2-D split]).
    """
    u = ulysses_size
    if doc_lengths is None:
        return []
    s = sum(doc_lengths)
    runs: list[tuple[int, int]] = []
    at = 0
    for n in doc_lengths:
        if n % 2:
            raise ValueError(f"a document's local rows ({n}) must be even (two zigzag chunks)")
        half = n // 2
        if half:
            runs += [(m * s + at, half) for m in range(u)]
            runs += [(m * s + at + half, half) for m in reversed(range(u))]
        at += n
    return runs
