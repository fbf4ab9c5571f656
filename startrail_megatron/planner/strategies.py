"""The strategies compared: one registry entry per kind, the one place that says what each is.

A ``Strategy`` is a kind and, for StarTrail, a team size C (1 = ring attention)
and a placement; for the 2-D split (kind ``"split"``: Ulysses over U ranks, StarTrail over
P / U, ``schedule/ulysses.py``) also U. ``KINDS`` maps each kind to its ``KindSpec``: its candidates,
when it can run, its name, its bytes and calls per rank (from ``accounting``),
its pieces of the cost model (attention time, buffer work, attention working
set: functions of ``times``, ``buffers``, ``memory``) and, imported only when
asked for (the planner never imports torch), its attention function for the
benchmark. A new kind is one entry here and its pieces there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from ..accounting import (
    allgather_comm_bytes,
    allgather_comm_calls,
    split_comm_bytes,
    split_comm_calls,
    split_ring_shape,
    startrail_comm_bytes,
    startrail_comm_calls,
    ulysses_comm_bytes,
    ulysses_comm_calls,
    ulysses_supported,
)
from ..schedule import tail_head_groups
from ..schedule.layout import PLACEMENTS, Placement, StarTrailLayout, valid_team_sizes
from ..schedule.packing import PackedLayout
from ..schedule.ulysses import UlyssesLayout, kv_repeat
from . import buffers, memory, times
from .cluster import ClusterSpec, ModelSpec
from .shape import AttnShape

__all__ = [
    "KINDS",
    "STRATEGY_KINDS",
    "KindSpec",
    "Strategy",
    "StrategyKind",
    "attention_fn",
    "buffer_bytes",
    "candidate_strategies",
    "comm_bytes",
    "comm_calls",
    "memory_bytes",
    "split_parts",
]


StrategyKind = Literal["startrail", "split", "allgather", "ulysses"]
"""The kinds of ``KINDS``, for type checkers."""


@dataclass(frozen=True)
class Strategy:
    """One way to run context-parallel attention."""

    kind: StrategyKind
    team_size: int = 1
    """StarTrail's C (1 = ring attention); 1 for the peers."""
    placement: Placement = "team"
    """StarTrail's placement; ignored by the peers."""
    ulysses_size: int = 1
    """U of the 2-D split (kind ``"split"``, U > 1); 1 for every other kind."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"strategy kind={self.kind!r} is not known; allowed: {STRATEGY_KINDS}")
        if isinstance(self.placement, list):
            object.__setattr__(self, "placement", tuple(self.placement))
        if isinstance(self.placement, str) and self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement={self.placement!r} is not known; allowed: {PLACEMENTS} or a map"
            )
        u = self.ulysses_size
        if not isinstance(u, int) or u < 1 or (u > 1) != (self.kind == "split"):
            raise ValueError(
                f"ulysses_size={u!r}: the 'split' kind takes an integer > 1, the others 1"
            )

    @property
    def spec(self) -> KindSpec:
        """Its kind's registry entry."""
        return KINDS[self.kind]

    @property
    def name(self) -> str:
        return self.spec.name(self)

    @property
    def placement_label(self) -> str:
        """The placement where it means something (StarTrail with C > 1), else ``"-"``; a
        map (``planner.placement.node_map``) is ``"map"``."""
        if not (self.spec.teams and self.team_size > 1):
            return "-"
        return self.placement if isinstance(self.placement, str) else "map"

    def layout(self, cp_size: int) -> StarTrailLayout:
        """StarTrail's rank arithmetic for this C and placement on ``cp_size`` ranks."""
        return StarTrailLayout(cp_size, self.team_size, self.placement)

    def split_layout(self, cp_size: int) -> UlyssesLayout:
        """The 2-D split's rank arithmetic (kind ``"split"``) on ``cp_size`` ranks."""
        return UlyssesLayout(cp_size, self.ulysses_size, self.team_size, self.placement)


Bytes = list[dict[str, int]]
"""Per rank: ``fwd_p2p``, ``bwd_p2p``, ``fwd_collective``, ``bwd_collective``."""
AttentionFn = Callable[..., object]
"""``fn(q, k, v, ledger, comm=None) -> out``, autograd-enabled (the benchmark's step);
``comm``: a ``comm.CommOptions`` (injected delay, no-overlap baseline) or ``None``."""


@dataclass(frozen=True)
class KindSpec:
    """Everything the planner and the benchmark need to know about one kind."""

    kind: str
    teams: bool
    """Has a team size and a placement (StarTrail); the peers ignore both."""
    variants: Callable[[int], list[Strategy]]
    """Its candidates for a CP size, in planner order."""
    supported: Callable[[int, int, int], bool]
    """Whether it runs for (cp_size, heads_q, heads_kv)."""
    requirement: str
    """Why it cannot run when ``supported`` says no; fields cp_size, heads_q, heads_kv."""
    name: Callable[[Strategy], str]
    comm_bytes: Callable[[Strategy, AttnShape], Bytes]
    comm_calls: Callable[[Strategy, AttnShape], Bytes]
    times: Callable[[Strategy, ClusterSpec, AttnShape], tuple[float, float]]
    """(forward, backward) seconds of the attention, the overlaps its code makes included."""
    buffer_bytes: Callable[[Strategy, AttnShape, bool], tuple[int, int]]
    """(forward, backward) elementwise bytes; the flag: reduce-scatter via all-reduce."""
    attention_work: Callable[[Strategy, AttnShape], int]
    """The attention's working set at its peak, bytes."""
    attention: Callable[[Strategy, bool, object], AttentionFn]
    """Its attention as ``fn(q, k, v, ledger)`` for causal or not, on a kernel (a name or
    an ``AttentionKernel``); imports torch (lazily) and may create process groups (a
    collective: every rank, in the same order)."""
    variant_supported: Callable[[Strategy, int, int], bool] = lambda st, hq, hkv: True
    """Whether one of its variants runs for (heads_q, heads_kv) (the split's U and heads)."""


def _always(cp_size: int, heads_q: int, heads_kv: int) -> bool:
    return True


def _kind_name(st: Strategy) -> str:
    return st.kind


# ---- StarTrail (ring = C 1) ------------------------------------------------------
def _startrail_variants(cp_size: int) -> list[Strategy]:
    """Every valid C and distinct placement (C = 1 is ring); a placement is listed once
    when both give the same rank map (C = 1 and C*C = P)."""
    out: list[Strategy] = []
    for c in valid_team_sizes(cp_size):
        seen: set[tuple] = set()
        for pl in PLACEMENTS:
            lay = StarTrailLayout(cp_size, c, pl)
            key = tuple(lay.coord(r) for r in range(cp_size))
            if key not in seen:
                seen.add(key)
                out.append(Strategy("startrail", c, pl))
    return out


def _startrail_name(st: Strategy) -> str:
    if st.team_size == 1:
        return "ring"
    return f"startrail-C{st.team_size}-{st.placement_label}"


def _startrail_comm_bytes(st: Strategy, shape: AttnShape) -> Bytes:
    lay = st.layout(shape.cp_size)
    active = shape.active_steps(lay)
    return [startrail_comm_bytes(lay, r, shape.local, active) for r in range(shape.cp_size)]


def _startrail_comm_calls(st: Strategy, shape: AttnShape) -> Bytes:
    lay = st.layout(shape.cp_size)
    active = shape.active_steps(lay)
    tail = len(tail_head_groups(lay, shape.heads_q, shape.heads_kv, False))
    return [
        startrail_comm_calls(lay.team_size, lay.p2p_sends(r, backward=True, active=active), tail)
        for r in range(shape.cp_size)
    ]


def _startrail_times(st: Strategy, cl: ClusterSpec, shape: AttnShape):
    return times.startrail_times(st.layout(shape.cp_size), cl, shape, comm_bytes(st, shape))


def _startrail_buffers(st: Strategy, shape: AttnShape, rs_via_allreduce: bool):
    return buffers.startrail_buffer_bytes(st.layout(shape.cp_size), shape, rs_via_allreduce)


def _startrail_work(st: Strategy, shape: AttnShape) -> int:
    return memory.startrail_attention_work(st.team_size, shape)


def _startrail_attention(st: Strategy, causal: bool, kernel) -> AttentionFn:
    from ..attention import startrail_attention
    from ..groups import StarTrailGroups

    groups = StarTrailGroups.create(st.team_size, placement=st.placement)
    return lambda q, k, v, ledger, comm=None: startrail_attention(
        q, k, v, groups, causal=causal, ledger=ledger, comm_options=comm, kernel=kernel
    )


# ---- StarTrail x Ulysses (the 2-D split) -------------------------------------------
def _split_variants(cp_size: int) -> list[Strategy]:
    """Every U with 1 < U < P dividing P, then every valid C over R = P / U and distinct
    placement (U = P is the Ulysses peer)."""
    out: list[Strategy] = []
    for u in range(2, cp_size):
        if cp_size % u == 0:
            for st in _startrail_variants(cp_size // u):
                out.append(Strategy("split", st.team_size, st.placement, u))
    return out


def _split_supported(st: Strategy, heads_q: int, heads_kv: int) -> bool:
    try:
        kv_repeat(st.ulysses_size, heads_q, heads_kv)
    except ValueError:
        return False
    return True


def _split_name(st: Strategy) -> str:
    return f"{_startrail_name(st)}+ulysses{st.ulysses_size}"


def split_parts(st: Strategy, shape: AttnShape) -> tuple[UlyssesLayout, AttnShape]:
    """The split's layout and the shape its ring groups run (``U*s`` tokens, heads / U,
    K,V heads repeated up to U; packed documents laid out for R ranks)."""
    lay = st.split_layout(shape.cp_size)
    ring = split_ring_shape(lay, shape.local)
    packed = shape.packed
    if packed is not None:
        packed = PackedLayout.create(lay.ring_size, packed.cu_seqlens, packed.cu_seqlens_padded)
    return lay, replace(
        shape, cp_size=lay.ring_size, s_local=ring.s_local, heads_q=ring.heads_q,
        heads_kv=ring.heads_kv, packed=packed,
    )  # fmt: skip


def _split_comm_bytes(st: Strategy, shape: AttnShape) -> Bytes:
    lay, ring = split_parts(st, shape)
    active = ring.active_steps(lay.ring)
    return [split_comm_bytes(lay, r, shape.local, active) for r in range(shape.cp_size)]


def _split_comm_calls(st: Strategy, shape: AttnShape) -> Bytes:
    lay, ring = split_parts(st, shape)
    active = ring.active_steps(lay.ring)
    tail = len(tail_head_groups(lay.ring, ring.heads_q, ring.heads_kv, False))
    return [split_comm_calls(lay, r, tail, active) for r in range(shape.cp_size)]


def _split_times(st: Strategy, cl: ClusterSpec, shape: AttnShape):
    lay, ring = split_parts(st, shape)
    return times.split_times(lay, cl, shape, ring)


def _split_buffers(st: Strategy, shape: AttnShape, rs_via_allreduce: bool):
    lay, ring = split_parts(st, shape)
    f, b = buffers.startrail_buffer_bytes(lay.ring, ring, rs_via_allreduce)
    a2a = buffers.split_a2a_bytes(ring)
    return f + a2a, b + a2a


def _split_work(st: Strategy, shape: AttnShape) -> int:
    _, ring = split_parts(st, shape)
    return memory.startrail_attention_work(st.team_size, ring) + memory.split_a2a_work(ring)


def _split_attention(st: Strategy, causal: bool, kernel) -> AttentionFn:
    from ..attention import startrail_attention
    from ..groups import UlyssesStarTrailGroups

    groups = UlyssesStarTrailGroups.create(st.ulysses_size, st.team_size, placement=st.placement)
    return lambda q, k, v, ledger, comm=None: startrail_attention(
        q, k, v, groups, causal=causal, ledger=ledger, comm_options=comm, kernel=kernel
    )


# ---- the peers -------------------------------------------------------------------
def _peer_attention(name: str) -> Callable[[Strategy, bool, object], AttentionFn]:
    """A peer of ``peers/`` by name, on the whole CP group (the default group)."""

    def attention(st: Strategy, causal: bool, kernel) -> AttentionFn:
        from .. import peers

        fn = getattr(peers, name)
        return lambda q, k, v, ledger, comm=None: fn(
            q, k, v, None, causal=causal, ledger=ledger, comm_options=comm, kernel=kernel
        )

    return attention


KINDS: dict[str, KindSpec] = {
    spec.kind: spec
    for spec in (
        KindSpec(
            kind="startrail",
            teams=True,
            variants=_startrail_variants,
            supported=_always,
            requirement="",
            name=_startrail_name,
            comm_bytes=_startrail_comm_bytes,
            comm_calls=_startrail_comm_calls,
            times=_startrail_times,
            buffer_bytes=_startrail_buffers,
            attention_work=_startrail_work,
            attention=_startrail_attention,
        ),
        KindSpec(
            kind="split",
            teams=True,
            variants=_split_variants,
            supported=_always,
            requirement="",
            name=_split_name,
            comm_bytes=_split_comm_bytes,
            comm_calls=_split_comm_calls,
            times=_split_times,
            buffer_bytes=_split_buffers,
            attention_work=_split_work,
            attention=_split_attention,
            variant_supported=_split_supported,
        ),
        KindSpec(
            kind="allgather",
            teams=False,
            variants=lambda cp_size: [Strategy("allgather")],
            supported=_always,
            requirement="",
            name=_kind_name,
            comm_bytes=lambda st, sh: [allgather_comm_bytes(sh.cp_size, sh.local)] * sh.cp_size,
            comm_calls=lambda st, sh: [allgather_comm_calls(sh.cp_size)] * sh.cp_size,
            times=lambda st, cl, sh: times.allgather_times(cl, sh, comm_bytes(st, sh)),
            buffer_bytes=lambda st, sh, rs: buffers.allgather_buffer_bytes(sh, rs),
            attention_work=lambda st, sh: memory.allgather_attention_work(sh),
            attention=_peer_attention("allgather_attention"),
        ),
        KindSpec(
            kind="ulysses",
            teams=False,
            variants=lambda cp_size: [Strategy("ulysses")],
            supported=ulysses_supported,
            requirement="Ulysses needs heads_q ({heads_q}) and heads_kv ({heads_kv}) divisible "
            "by cp_size {cp_size}",
            name=_kind_name,
            comm_bytes=lambda st, sh: [ulysses_comm_bytes(sh.cp_size, sh.local)] * sh.cp_size,
            comm_calls=lambda st, sh: [ulysses_comm_calls(sh.cp_size)] * sh.cp_size,
            times=lambda st, cl, sh: times.ulysses_times(cl, sh, comm_bytes(st, sh)),
            buffer_bytes=lambda st, sh, rs: buffers.ulysses_buffer_bytes(sh, rs),
            attention_work=lambda st, sh: memory.ulysses_attention_work(sh),
            attention=_peer_attention("ulysses_attention"),
        ),
    )
}
STRATEGY_KINDS: tuple[str, ...] = tuple(KINDS)


# ---- per strategy, through the registry --------------------------------------------
def candidate_strategies(cp_size: int, heads_q: int, heads_kv: int) -> list[Strategy]:
    """StarTrail for every valid C and distinct placement (C = 1 is ring), the 2-D split
    for every U (1 < U < P) its heads allow and every C and placement over P / U, then the
    peers.

    A placement is listed once when both give the same rank map (C = 1 and C*C = P).
    """
    out: list[Strategy] = []
    for spec in KINDS.values():
        if spec.supported(cp_size, heads_q, heads_kv):
            out += [
                st for st in spec.variants(cp_size) if spec.variant_supported(st, heads_q, heads_kv)
            ]
    return out


def comm_bytes(strategy: Strategy, shape: AttnShape) -> Bytes:
    """Per rank: ``fwd_p2p``, ``bwd_p2p``, ``fwd_collective``, ``bwd_collective`` bytes sent."""
    return strategy.spec.comm_bytes(strategy, shape)


def comm_calls(strategy: Strategy, shape: AttnShape) -> Bytes:
    """Per rank: communication calls, same keys as ``comm_bytes``."""
    return strategy.spec.comm_calls(strategy, shape)


def buffer_bytes(
    strategy: Strategy, shape: AttnShape, *, rs_via_allreduce: bool = False
) -> tuple[int, int]:
    """(forward, backward) bytes read + written per rank by the tensor ops outside the
    kernels and the communication, max over ranks (``buffers``: what is counted)."""
    return strategy.spec.buffer_bytes(strategy, shape, rs_via_allreduce)


def memory_bytes(
    strategy: Strategy,
    shape: AttnShape,
    model: ModelSpec,
    zero_shards: int | None = None,
    features: memory.StepFeatures | None = None,
) -> dict[str, float]:
    """Peak memory per rank (``memory.memory_breakdown`` of this strategy's attention
    working set): ``model_states``, ``checkpoints``, ``layer``, ``attention_work``,
    ``total``; with ``features``, the whole step's (``activations``, ``bytes_per_token``)."""
    work = strategy.spec.attention_work(strategy, shape)
    named = None
    if features is not None and strategy.kind == "startrail":
        named = memory.startrail_buffers(
            strategy.team_size, shape, features.attention_tile, features.attention_head_chunks
        )
    team = strategy.team_size if strategy.kind == "startrail" else 1
    return memory.memory_breakdown(work, shape, model, zero_shards, features, named, team)


def attention_fn(strategy: Strategy, causal: bool, kernel="auto") -> AttentionFn:
    """The strategy's attention as ``fn(q, k, v, ledger)`` on ``kernel`` (a name or an
    ``AttentionKernel``; imports torch; StarTrail creates its process groups here, a
    collective)."""
    return strategy.spec.attention(strategy, causal, kernel)
