"""The strategies the planner compares: StarTrail for every (C, placement), ring (C = 1)
and the peers; their bytes and calls per rank (from ``accounting``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..accounting import (
    allgather_comm_bytes,
    allgather_comm_calls,
    startrail_comm_bytes,
    startrail_comm_calls,
    ulysses_comm_bytes,
    ulysses_comm_calls,
    ulysses_supported,
)
from ..layout import PLACEMENTS, Placement, StarTrailLayout, valid_team_sizes
from .shape import AttnShape

__all__ = [
    "STRATEGY_KINDS",
    "Strategy",
    "StrategyKind",
    "candidate_strategies",
    "comm_bytes",
    "comm_calls",
]


StrategyKind = Literal["startrail", "allgather", "ulysses"]


STRATEGY_KINDS: tuple[str, ...] = ("startrail", "allgather", "ulysses")


@dataclass(frozen=True)
class Strategy:
    """One way to run context-parallel attention."""

    kind: StrategyKind
    team_size: int = 1
    """StarTrail's C (1 = ring attention); 1 for the peers."""
    placement: Placement = "team"
    """StarTrail's placement; ignored by the peers."""

    def __post_init__(self) -> None:
        if self.kind not in STRATEGY_KINDS:
            raise ValueError(f"strategy kind={self.kind!r} is not known; allowed: {STRATEGY_KINDS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not known; allowed: {PLACEMENTS}")

    @property
    def name(self) -> str:
        if self.kind != "startrail":
            return self.kind
        if self.team_size == 1:
            return "ring"
        return f"startrail-C{self.team_size}-{self.placement}"


def candidate_strategies(cp_size: int, heads_q: int, heads_kv: int) -> list[Strategy]:
    """StarTrail for every valid C and distinct placement (C = 1 is ring), then the peers.

    A placement is listed once when both give the same rank map (C = 1 and C*C = P).
    """
    out: list[Strategy] = []
    for c in valid_team_sizes(cp_size):
        seen: set[tuple] = set()
        for pl in PLACEMENTS:
            lay = StarTrailLayout(cp_size, c, pl)
            key = tuple(lay.coord(r) for r in range(cp_size))
            if key not in seen:
                seen.add(key)
                out.append(Strategy("startrail", c, pl))
    out.append(Strategy("allgather"))
    if ulysses_supported(cp_size, heads_q, heads_kv):
        out.append(Strategy("ulysses"))
    return out


def comm_bytes(strategy: Strategy, shape: AttnShape) -> list[dict[str, int]]:
    """Per rank: ``fwd_p2p``, ``bwd_p2p``, ``fwd_collective``, ``bwd_collective`` bytes sent."""
    p = shape.cp_size
    if strategy.kind == "startrail":
        lay = StarTrailLayout(p, strategy.team_size, strategy.placement)
        return [
            startrail_comm_bytes(lay.team_size, lay.p2p_sends(r, backward=True), shape.local)
            for r in range(p)
        ]
    fn = allgather_comm_bytes if strategy.kind == "allgather" else ulysses_comm_bytes
    return [fn(p, shape.local)] * p


def comm_calls(strategy: Strategy, shape: AttnShape) -> list[dict[str, int]]:
    """Per rank: communication calls, same keys as ``comm_bytes``."""
    p = shape.cp_size
    if strategy.kind == "allgather":
        return [allgather_comm_calls(p)] * p
    if strategy.kind == "ulysses":
        return [ulysses_comm_calls(p)] * p
    lay = StarTrailLayout(p, strategy.team_size, strategy.placement)
    return [startrail_comm_calls(lay.team_size, lay.p2p_sends(r, backward=True)) for r in range(p)]
