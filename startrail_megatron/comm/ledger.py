"""Communication accounting: what one rank sends, recorded per call.

Pass a ``CommLedger`` to any StarTrail or peer attention and every transfer is
recorded: exact running totals per (phase, kind, op, tensor, peer), plus the
last ``max_events`` ``CommEvent``s (a long training run keeps a ledger open: it
must not grow). Where a transport can time its waits (``overlap.py``), each wait is
also recorded: seconds in flight before it and seconds it blocked, per (phase, kind,
tensor), and ``hidden`` turns them into the fraction hidden. ``nbytes`` is what *this rank sends*: the message size for a
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
    group: tuple[int, ...] | None = None
    """Global ranks: a collective's members in group order; a P2P send's destination."""


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
        self._waits: dict[tuple[str, str, str], list] = {}

    @classmethod
    def from_events(cls, events, max_events: int | None = None) -> CommLedger:
        """A ledger holding ``events`` (e.g. another rank's, sent back as a list)."""
        led = cls(max_events=max_events)
        for e in events:
            led.phase = e.phase
            led.record(e.kind, e.op, e.what, e.nbytes, e.peer, e.group)
        led.phase = "fwd"
        return led

    def record(
        self,
        kind: Kind,
        op: str,
        what: str,
        nbytes: int,
        peer: int | None = None,
        group: tuple[int, ...] | None = None,
    ) -> None:
        group = tuple(group) if group is not None else None
        ev = CommEvent(self.phase, kind, op, what, int(nbytes), peer, group)
        self.events.append(ev)
        tot = self._totals.setdefault((ev.phase, kind, op, what, peer, group), [0, 0])
        tot[0] += ev.nbytes
        tot[1] += 1

    def record_wait(
        self, phase: str | None, kind: Kind, what: str, in_flight_s: float, exposed_s: float
    ) -> None:
        """One transfer's wait: ``in_flight_s`` from its issue to the ``wait()`` call,
        ``exposed_s`` blocked in the wait (``overlap.TimedHandle``)."""
        w = self._waits.setdefault((phase or self.phase, kind, what), [0, 0.0, 0.0])
        w[0] += 1
        w[1] += max(0.0, in_flight_s)
        w[2] += max(0.0, exposed_s)

    def waits(self) -> dict[str, dict[str, float]]:
        """Per ``"phase/kind/what"``: waits timed, seconds in flight, seconds exposed, and
        the fraction hidden (in flight / (in flight + exposed))."""
        out = {}
        for (ph, k, w), (n, fly, exp) in sorted(self._waits.items()):
            tot = fly + exp
            out[f"{ph}/{k}/{w}"] = {
                "count": n,
                "in_flight_s": fly,
                "exposed_s": exp,
                "hidden": fly / tot if tot > 0 else 1.0,
            }
        return out

    def hidden(self, kind: Kind | None = None, phase: str | None = None) -> float | None:
        """The fraction of the timed transfers' time hidden behind other work (``None``:
        nothing timed)."""
        fly = exp = 0.0
        for (ph, k, _w), (_n, f, e) in self._waits.items():
            if (kind is None or k == kind) and (phase is None or ph == phase):
                fly, exp = fly + f, exp + e
        if not self._waits or fly + exp == 0:
            return None
        return fly / (fly + exp)

    def exposed_s(self, kind: Kind | None = None, phase: str | None = None) -> float:
        """Seconds this rank blocked in waits (of the timed transfers)."""
        return sum(
            e
            for (ph, k, _w), (_n, _f, e) in self._waits.items()
            if (kind is None or k == kind) and (phase is None or ph == phase)
        )

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
            for (ph, k, _op, w, _peer, _group), t in self._totals.items()
            if (kind is None or k == kind)
            and (phase is None or ph == phase)
            and (what is None or w == what)
        ]

    def bytes_by_link(self, me: int, node_of, cp_ranks: list[int] | None = None) -> dict[str, int]:
        """What this rank (global rank ``me``) sent inside its node and to other nodes, from
        its exact totals and ``node_of(global rank) -> node``. A P2P send goes to its
        destination's node: the global rank recorded with it, else its peer (a CP rank)
        through ``cp_ranks[peer]``, CP rank i's global rank (default: the same numbers;
        the 2-D split's sub-ring peers are ranks of a ring group, so its transports record
        the global one). An all-gather or reduce-scatter sends its whole
        volume to the member after this one in the group's order (the ring algorithm of
        gloo and NCCL); an all-to-all sends an equal share to each other member (the
        remainder's bytes to the first of them). A
        collective recorded without its group is counted under ``"unknown"``."""
        out = {"intra_node": 0, "inter_node": 0, "unknown": 0}
        home = node_of(me)

        def add(dst: int, nb: int) -> None:
            out["intra_node" if node_of(dst) == home else "inter_node"] += nb

        for (_ph, kind, op, _w, peer, group), (nb, _n) in self._totals.items():
            if kind == "p2p" and group:
                add(group[0], nb)
            elif kind == "p2p" and peer is not None:
                add(cp_ranks[peer] if cp_ranks is not None else peer, nb)
            elif group is None or me not in group:
                out["unknown"] += nb
            elif op == "all_to_all":
                others = [g for g in group if g != me]
                share, extra = divmod(nb, len(others))  # every byte counted once
                for i, g in enumerate(others):
                    add(g, share + (i < extra))
            else:
                add(group[(group.index(me) + 1) % len(group)], nb)
        return out

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
        self._waits.clear()


def nbytes(t) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()
