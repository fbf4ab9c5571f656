"""Bytes and calls each rank sends in one attention forward and backward: pure ints, no torch.

One function per strategy, all on one shape argument (``LocalShape``: one
rank's tensors), all returning the same keys: ``fwd_p2p``, ``bwd_p2p``,
``fwd_collective``, ``bwd_collective``. Ints in, ints out; this module imports
only the pure ``layout.py``. The tests check every one of them
against the ``CommLedger`` of real runs; the planner and the benchmark use
them as they are. Collectives count the ring-algorithm volume: (n-1)/n of the
full buffer over n ranks.

Notation: u_q, u_kv are the elements of one local q (or out) and one local k
(or v) tensor; ``elem``: input dtype bytes; ``acc``: accumulation dtype
bytes (fp32: 4, fp64: 8); C the team size, G = P/C^2.

StarTrail (ring = C 1; the formulas are explained in ``attention.py``'s docstring;
message counts: ``StarTrailLayout.p2p_sends``; under a sliding window ``kv`` and
``dkv`` count only the hops between the steps computed, ``startrail_active_steps``)

  fwd  P2P         kv_place * 2 u_kv elem + kv * C 2 u_kv elem
       collective  (C-1) (u_q elem + C s b h_q acc + u_q acc)
  bwd  P2P         kv_place * 2 u_kv elem + kv * C 2 u_kv elem
                   + dkv * C 2 u_kv acc + dkv_home * 2 u_kv acc
       collective  (C-1) (u_q elem + s b h_q acc + u_q acc)

The peers (``peers/``)

  all-gather   fwd  all-gather K,V           (P-1) 2 u_kv elem
               bwd  all-gather K,V again     (P-1) 2 u_kv elem
                    reduce-scatter dK,dV     (P-1) 2 u_kv acc
  Ulysses      fwd  all-to-all q, k, v, out  (P-1)/P (2 u_q + 2 u_kv) elem
               bwd  dout, dq, dk, dv         (P-1)/P (2 u_q + 2 u_kv) elem

StarTrail x Ulysses (P = U x R; ``schedule/ulysses.py``'s Note [the 2-D split]):
the all-to-alls of Ulysses over U ranks (K,V repeated to U heads when ``heads_kv`` < U:
u_kv' = u_kv * max(1, U / h_kv)), plus StarTrail over R ranks on the shape after the
all-to-all, ``[U*s, b, h_q/U, h_kv'/U, d]`` (the same elements per tensor as before it):

  fwd  collective  (U-1)/U (2 u_q + 2 u_kv') elem  + StarTrail(R, C) on that shape
  bwd  collective  (U-1)/U (2 u_q + 2 u_kv') elem  + StarTrail(R, C) on that shape
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .schedule.layout import ActiveSteps, StarTrailLayout
from .schedule.ulysses import UlyssesLayout, kv_repeat

__all__ = [
    "LocalShape",
    "allgather_comm_bytes",
    "allgather_comm_calls",
    "startrail_comm_bytes",
    "startrail_comm_calls",
    "split_all_to_all_bytes",
    "split_comm_bytes",
    "split_comm_calls",
    "split_ring_shape",
    "ulysses_comm_bytes",
    "ulysses_comm_calls",
    "ulysses_supported",
]


@dataclass(frozen=True)
class LocalShape:
    """One CP rank's attention tensors: q ``[s_local, batch, heads_q, head_dim]``,
    k and v ``[s_local, batch, heads_kv, head_dim]``, and the dtype sizes."""

    s_local: int
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    elem_bytes: int
    """Input dtype bytes (bf16: 2)."""
    acc_bytes: int = 4
    """Accumulation dtype bytes (fp32: 4; fp64 runs: 8)."""

    @property
    def tokens(self) -> int:
        """Local token rows, s_local * batch."""
        return self.s_local * self.batch

    @property
    def q_elems(self) -> int:
        """u_q: elements of one local q (or out) tensor."""
        return self.tokens * self.heads_q * self.head_dim

    @property
    def kv_elems(self) -> int:
        """u_kv: elements of one local k (or v) tensor."""
        return self.tokens * self.heads_kv * self.head_dim


def _keys(fwd_p2p: int, bwd_p2p: int, fwd_coll: int, bwd_coll: int) -> dict[str, int]:
    return {
        "fwd_p2p": fwd_p2p,
        "bwd_p2p": bwd_p2p,
        "fwd_collective": fwd_coll,
        "bwd_collective": bwd_coll,
    }


# ---- StarTrail (ring = C 1) ----------------------------------------------------
def startrail_comm_bytes(
    layout: StarTrailLayout, rank: int, shape: LocalShape, active: ActiveSteps | None = None
) -> dict[str, int]:
    """Bytes CP rank ``rank`` of ``layout`` sends in one StarTrail attention forward and
    backward (its P2P message counts: ``StarTrailLayout.p2p_sends``). ``active``: the
    sub-ring steps computed (``schedule.startrail_active_steps``; ``None``: all)."""
    c = layout.team_size
    sends = layout.p2p_sends(rank, backward=True, active=active)
    tok, acc_bytes, elem_bytes = shape.tokens, shape.acc_bytes, shape.elem_bytes
    q_el, kv_el, heads_q = shape.q_elems, shape.kv_elems, shape.heads_q
    local_kv = 2 * kv_el  # one rank's K and V
    team_kv = c * local_kv  # K and V of the whole team
    place = sends["kv_place"] * local_kv * elem_bytes
    ring_kv = sends["kv"] * team_kv * elem_bytes
    return _keys(
        place + ring_kv,
        place + ring_kv + (sends["dkv"] * team_kv + sends["dkv_home"] * local_kv) * acc_bytes,
        # all-gather q; all-gather the team rows' partial lse; reduce-scatter out
        (c - 1) * (q_el * elem_bytes + c * tok * heads_q * acc_bytes + q_el * acc_bytes),
        # all-gather dout and delta; reduce-scatter dq
        (c - 1) * (q_el * elem_bytes + tok * heads_q * acc_bytes + q_el * acc_bytes),
    )


def startrail_comm_calls(
    team_size: int, sends: Mapping[str, int], tail_groups: int = 1, head_chunks: int = 1
) -> dict[str, int]:
    """Calls one rank makes: its P2P messages ``sends`` (as for ``startrail_comm_bytes``);
    with teams (C > 1) the forward's q all-gather and, per head group of its last step
    (``tail_groups``: ``len(schedule.tail_head_groups(...))``), an lse all-gather and an
    out reduce-scatter; the backward's dout and delta all-gathers and, per head group of
    its last step, a dq reduce-scatter. K and V need none: the placement sends them
    straight from each member (``layout.py``'s Note). ``head_chunks``: the call runs that
    many times on a KV-head group each (``startrail_attention(head_chunks=)``; the same
    bytes): every count times it, ``tail_groups`` then counted on one chunk's heads."""
    n = head_chunks
    fwd_coll = 1 + 2 * tail_groups if team_size > 1 else 0
    bwd_coll = 2 + tail_groups if team_size > 1 else 0
    fwd_p2p = sends["kv_place"] + sends["kv"]
    bwd_p2p = fwd_p2p + sends["dkv"] + sends["dkv_home"]
    return _keys(n * fwd_p2p, n * bwd_p2p, n * fwd_coll, n * bwd_coll)


# ---- all-gather KV ---------------------------------------------------------------
def allgather_comm_bytes(cp_size: int, shape: LocalShape) -> dict[str, int]:
    """Bytes one rank sends in one all-gather-KV attention forward and backward.

    Every transfer is a collective.
    """
    kv = 2 * shape.kv_elems  # local K and V elements
    p1 = cp_size - 1
    return _keys(0, 0, p1 * kv * shape.elem_bytes, p1 * kv * (shape.elem_bytes + shape.acc_bytes))


def allgather_comm_calls(cp_size: int) -> dict[str, int]:
    """Collective calls per rank: forward 1 (all-gather), backward 2."""
    n = int(cp_size > 1)
    return _keys(0, 0, n, 2 * n)


# ---- Ulysses ---------------------------------------------------------------------
def ulysses_comm_bytes(cp_size: int, shape: LocalShape) -> dict[str, int]:
    """Bytes one rank sends in one Ulysses attention forward and backward.

    Ulysses moves only input-dtype tensors (``acc_bytes`` plays no part).
    """
    per = 2 * shape.q_elems + 2 * shape.kv_elems  # q, out, k, v
    each = (cp_size - 1) * per * shape.elem_bytes // cp_size
    return _keys(0, 0, each, each)


def ulysses_comm_calls(cp_size: int) -> dict[str, int]:
    """All-to-all calls per rank: forward 4 (q, k, v, out), backward 4."""
    n = 4 * int(cp_size > 1)
    return _keys(0, 0, n, n)


def ulysses_supported(cp_size: int, heads_q: int, heads_kv: int) -> bool:
    """Ulysses shards heads: both head counts must be multiples of the CP size."""
    return heads_q % cp_size == 0 and heads_kv % cp_size == 0


# ---- StarTrail x Ulysses -----------------------------------------------------------
def split_ring_shape(layout: UlyssesLayout, shape: LocalShape) -> LocalShape:
    """The shape StarTrail's ring group sees after the all-to-all: ``U*s`` tokens, the
    query heads / U, the (repeated when fewer than U) KV heads / U."""
    u = layout.ulysses_size
    hkv = shape.heads_kv * kv_repeat(u, shape.heads_q, shape.heads_kv)
    return LocalShape(
        shape.s_local * u, shape.batch, shape.heads_q // u, hkv // u, shape.head_dim,
        shape.elem_bytes, shape.acc_bytes,
    )  # fmt: skip


def split_all_to_all_bytes(layout: UlyssesLayout, shape: LocalShape) -> int:
    """Bytes one rank sends in the split's four all-to-alls of one direction: (U-1)/U of q
    and out (forward; dout and dq backward) and of the (repeated) k, v, rounded down per
    tensor, as sent."""
    u, ring = layout.ulysses_size, split_ring_shape(layout, shape)
    q_t = shape.q_elems * shape.elem_bytes
    kv_t = shape.tokens * ring.heads_kv * u * shape.head_dim * shape.elem_bytes
    return 2 * ((u - 1) * q_t // u) + 2 * ((u - 1) * kv_t // u)


def split_comm_bytes(
    layout: UlyssesLayout, cp_rank: int, shape: LocalShape, active: ActiveSteps | None = None
) -> dict[str, int]:
    """Bytes CP rank ``cp_rank`` sends in one forward and backward of the 2-D split: each
    all-to-all (U-1)/U of its tensor (rounded down per tensor, as sent), plus StarTrail's
    over its ring group on ``split_ring_shape`` (``active``: its sub-ring steps)."""
    ring = split_ring_shape(layout, shape)
    a2a = split_all_to_all_bytes(layout, shape)
    inner = startrail_comm_bytes(layout.ring, layout.coord(cp_rank)[0], ring, active)
    inner["fwd_collective"] += a2a
    inner["bwd_collective"] += a2a
    return inner


def split_comm_calls(
    layout: UlyssesLayout, cp_rank: int, tail_groups: int = 1, active: ActiveSteps | None = None,
    head_chunks: int = 1,
) -> dict[str, int]:  # fmt: skip
    """Calls of one forward and backward of the 2-D split: 4 all-to-alls each way (with
    U > 1) and StarTrail's over the ring group (``tail_groups``, ``head_chunks``: as
    ``startrail_comm_calls``, over the ring shape's heads)."""
    ring_rank = layout.coord(cp_rank)[0]
    sends = layout.ring.p2p_sends(ring_rank, backward=True, active=active)
    calls = startrail_comm_calls(layout.team_size, sends, tail_groups, head_chunks)
    n = 4 * int(layout.ulysses_size > 1)
    calls["fwd_collective"] += n
    calls["bwd_collective"] += n
    return calls
