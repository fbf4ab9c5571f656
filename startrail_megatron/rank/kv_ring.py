"""The K,V ring of one call: initial placement, double-buffered sub-ring steps, dK/dV home.

The forward and the backward walk the same ring (``layout.py``'s Note [the StarTrail
schedule]): ``start_placement`` sends this rank's K,V to the C ranks that hold its team's
K,V at their first computed step; ``held`` then yields the K,V held at each computed step,
with the next one in flight while the caller computes on it (two buffers, reused); the
backward passes its dK/dV partial sums along the same ring (``pass_on``) and sends the
last holder's rows home (``send_dkv_home``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from torch import Tensor

from ..comm import Handle
from ..schedule.layout import ActiveSteps
from .call import RankCall
from .team_order import TeamOrder

__all__ = ["KVRing"]


class KVRing:
    """One call's K,V ring on one rank. ``active``: the steps each sub-ring computes
    (``RankCall.active_steps``); ``steps``: those this rank computes."""

    def __init__(self, rc: RankCall, order: TeamOrder, active: ActiveSteps | None):
        self.rc, self.order, self.active = rc, order, active
        self.steps: tuple[int, ...] = rc.layout.computed_steps(rc.rank, active)
        self._placement: tuple[Handle, Tensor | None] | None = None

    def start_placement(self, kv_local: Tensor) -> None:
        """Start the initial K,V placement (layout Note, step 2): this rank's K,V to the C
        ranks holding its team's K,V at their sub-rings' first computed steps, one piece
        from each member of the team whose K,V this rank holds at its first one, received
        into one member-order buffer (C > 1)."""
        lay, r, c = self.rc.layout, self.rc.rank, self.rc.layout.team_size
        sends = [(d, kv_local) for d in lay.placement_targets(r, self.active)]
        buf = kv_local.new_empty((c * kv_local.shape[0], *kv_local.shape[1:])) if c > 1 else None
        srcs = lay.placement_sources(r, self.active)
        handle = self.rc.p2p.exchange_many(sends, srcs, kv_local, "kv_place", out=buf)
        self._placement = (handle, buf, self._order_of(srcs[0]))

    def _wait_placement(self) -> Tensor:
        """The team's K,V in team order (C = 1: the one piece itself), reordered inside the
        member-order buffer it arrived in."""
        if self._placement is None:
            raise RuntimeError("KVRing.held before start_placement: the placement is not sent")
        handle, buf, order = self._placement
        self._placement = None
        pieces = handle.wait()
        first = pieces[0] if buf is None else None
        del pieces  # views of buf
        return first if buf is None else order.to_team(buf, in_place=True)

    def _order_of(self, member_rank: int) -> TeamOrder:
        """The team order of the team CP rank ``member_rank`` belongs to: a K,V copy is kept
        in its own team's buffer order, which is this rank's team's only where every team
        lists its members' chunks alike (the named placements), not under any map."""
        team = self.rc.layout.coord(member_rank)[0]
        if team == self.order.team:
            return self.order
        return dataclasses.replace(self.order, team=team, member=0)

    def held(self, kv_local: Tensor) -> Iterator[tuple[int, int, Tensor]]:
        """``(i, step, kv)`` for each computed step: the K,V ``[n, 2, b, hkv, d]`` (team
        order) held then. Waits for the placement first; the next step's K,V is in flight
        while the caller computes, received into the buffer the step before last computed
        on (``kv_local`` itself is kept for the backward: never a buffer to receive into)."""
        kv = self._wait_placement()
        spare = None
        for i, step in enumerate(self.steps):
            pending = self.pass_on(kv, i, "kv", spare)
            if pending is None:  # the last step receives no K,V: its spare buffer is dead
                spare = None
            yield i, step, kv
            if pending is not None:
                spare = None if kv is kv_local else kv
                kv = pending.wait()

    def pass_on(self, x: Tensor, i: int, what: str, out: Tensor | None = None) -> Handle | None:
        """Start passing ``x`` along the sub-ring to the rank that holds it at the next
        computed step ``steps[i + 1]`` (the next rank, or further past idle steps), and
        receiving from the one that holds ours now; None after the last step. ``out``: a
        free buffer like ``x`` to receive into."""
        steps = self.steps
        if i >= len(steps) - 1:
            return None
        lay, r, hops = self.rc.layout, self.rc.rank, steps[i + 1] - steps[i]
        return self.rc.p2p.exchange(
            x, lay.ring_shift(r, hops), lay.ring_shift(r, -hops), what, self.rc.subring_group, out
        )

    def send_dkv_home(self, dkv: Tensor) -> Handle:
        """Start sending each member its rows of the copy's dK/dV held after the last
        computed step (team order in; reordered in place: ``dkv`` is dead after); ``wait()`` gives this rank's rows of each copy of
        its team's dK/dV, to be summed."""
        lay, r, c = self.rc.layout, self.rc.rank, self.rc.layout.team_size
        targets = lay.dkv_home_targets(r, self.active)  # the held copy's team, member order
        order = self._order_of(targets[0])
        parts = order.from_team(dkv, in_place=True).chunk(c, dim=0) if c > 1 else (dkv,)
        sends = list(zip(targets, parts))
        srcs = lay.dkv_home_sources(r, self.active)
        return self.rc.p2p.exchange_many(sends, srcs, parts[0], "dkv_home")
