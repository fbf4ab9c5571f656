"""Communication accounting: what one rank sends, recorded per call.

Pass a ``CommLedger`` to any StarTrail or peer attention and every transfer is
recorded: exact running totals per (phase, kind, op, tensor, peer), plus the
last ``max_events`` ``CommEvent``s (a long training run keeps a ledger open: it
must not grow). ``nbytes`` is what *this rank sends*: the message size for a
P2P send, and the ring-algorithm volume ``(n-1)/n`` of the full buffer for an
all-gather or reduce-scatter over ``n`` ranks, ``(n-1)/n`` of the input for an
all-to-all. Transfers to oneself are never made. Pure Python: no torch import.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CommEvent", "CommLedger", "Kind", "nbytes"]

Kind = Literal["p2p", "collective"]


@dataclass(frozen=True)
class CommEvent:
    phase: str  # "fwd" or "bwd"
    kind: Kind
    op: str  # "send", "all_gather", "reduce_scatter", "all_to_all"
    what: str  # which tensor: "kv", "dkv", "qkv", "lse", ...
    nbytes: int
    peer: int | None = None  # CP rank for P2P


@dataclass
class CommLedger:
    """Per-rank record of every transfer the attention calls make.

    Totals (``bytes``, ``calls``, ``summary``) are exact over everything recorded
    since the last ``clear()``; ``events`` keeps the most recent ``max_events``
    transfers in order (``None``: all of them), so a ledger left open for a whole
    training run stays small.
    """

    max_events: int | None = 100_000
    phase: str = "fwd"
    events: deque[CommEvent] = field(init=False)
    _totals: dict[tuple, list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_events is not None and self.max_events < 0:
            raise ValueError(f"max_events={self.max_events} must be >= 0 or None")
        self.events = deque(maxlen=self.max_events)
        self._totals = {}

    @classmethod
    def from_events(cls, events, max_events: int | None = None) -> CommLedger:
        """A ledger holding ``events`` (e.g. another rank's, sent back as a list)."""
        led = cls(max_events=max_events)
        for e in events:
            led.phase = e.phase
            led.record(e.kind, e.op, e.what, e.nbytes, e.peer)
        led.phase = "fwd"
        return led

    def record(self, kind: Kind, op: str, what: str, nbytes: int, peer: int | None = None) -> None:
        ev = CommEvent(self.phase, kind, op, what, int(nbytes), peer)
        self.events.append(ev)
        tot = self._totals.setdefault((ev.phase, kind, op, what, peer), [0, 0])
        tot[0] += ev.nbytes
        tot[1] += 1

    def bytes(
        self, kind: Kind | None = None, phase: str | None = None, what: str | None = None
    ) -> int:
        return sum(t[0] for t in self._select(kind, phase, what))

    def calls(
        self, kind: Kind | None = None, phase: str | None = None, what: str | None = None
    ) -> int:
        return sum(t[1] for t in self._select(kind, phase, what))

    def _select(self, kind, phase, what) -> list[list[int]]:
        return [
            t
            for (ph, k, _op, w, _peer), t in self._totals.items()
            if (kind is None or k == kind)
            and (phase is None or ph == phase)
            and (what is None or w == what)
        ]

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ph in ("fwd", "bwd"):
            for kind in ("p2p", "collective"):
                out[f"{ph}_{kind}_bytes"] = self.bytes(kind, ph)
                out[f"{ph}_{kind}_calls"] = self.calls(kind, ph)
        return out

    def clear(self) -> None:
        self.events.clear()
        self._totals.clear()


def nbytes(t) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()
