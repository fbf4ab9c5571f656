"""Pure rank arithmetic of StarTrail: ints in, ints out, no torch.distributed.

Notation (StarTrail, arXiv 2407.00611, Algorithms 1-3): ``P`` context-parallel (CP) ranks
share one sequence, ``C`` is the team size, ``T = P/C`` teams, ``G = P/C^2``
teams per team group, ``C`` team groups, ``C^2`` sub-rings of ``G`` ranks.

Every CP rank ``r`` has a logical coordinate ``(t, a)``: team ``t`` and member
``a``. The *placement* maps coordinates onto CP ranks:

``"team"``  r = t*C + a. Team members are adjacent CP ranks, so the team
            all-gather / reduce-scatter stays inside a node.
``"ring"``  r = g*C*G + a*G + (t % G), g = t // G. The G ranks of a sub-ring
            are adjacent CP ranks, so the ring P2P stays inside a node.
a map       any permutation of the P CP ranks, a tuple: the CP rank of logical rank
            ``t*C + a`` is ``map[t*C + a]`` (``"team"`` is the identity). Every map runs
            the same algorithm on the same logical coordinates, so every map is exact;
            which CP ranks share a team, and which sub-ring hops cross a node, is what
            changes (``placement_code`` names it in agreement checks).

Data always follows the CP rank (Megatron's zigzag layout: CP rank ``r`` holds
sequence chunks ``r`` and ``2P-1-r`` of ``2P``); a team's chunks are those of
its members' CP ranks, whatever the placement.

Note [the StarTrail schedule]
-----------------------------
Forward, for rank (t, a):

  1. team all-gather of q: every member holds the queries of all its team's tokens.
  2. initial KV placement: team t's KV goes to (a*G + t//C, t%C) for every a, and
     rank (t, a) receives team (C*(t%G) + a, t//G)'s. The paper all-gathers K,V in
     the team and each member sends the team's KV to its own receiver; here each
     member sends its own K,V straight to the C receivers of its team's KV
     (``placement_targets``), and a receiver takes the C pieces from the members of
     that team (``placement_sources``): the same K,V arrives, with no K,V all-gather
     (C-1 local K,V fewer sent per rank, and a collective fewer to wait on).
     Now member a of team t holds KV team C*(t%G) + a.
  3. G steps on sub-ring (g, a): at step s compute against the KV held,
     while passing it to next(t) = (t+1)%G + G*g and receiving from prev(t).
     At step s, (t, a) holds KV team C*((t - s) mod G) + a.
  4. team combine of the C partial (out, lse).

Example P = 8, C = 2 (G = 2, T = 4, team placement), KV team held per step:

  rank (t,a) | step 0 | step 1          team t sees, over its 2 members,
  0    (0,0) |   0    |   2              KV teams {0,2} u {1,3}: all four,
  1    (0,1) |   1    |   3              each exactly once.
  2    (1,0) |   2    |   0
  3    (1,1) |   3    |   1
  4    (2,0) |   0    |   2
  5    (2,1) |   1    |   3
  6    (3,0) |   2    |   0
  7    (3,1) |   3    |   1

The backward (``rank/backward.py``) replays the same KV schedule; the KV copy
carries its running dK/dV along, and after step G-1 it goes home: the paper returns
the copy to the rank that sent it in step 2 (``dkv_return_peers``) and reduce-scatters
dK/dV in the team; here each member's rows go straight to that member
(``dkv_home_targets``), which sums the C copies' parts it receives
(``dkv_home_sources``): the same sums, with no dK/dV reduce-scatter.

Idle steps. Under a narrow sliding window some sub-ring steps have no kernel call on any
rank of the sub-ring (``schedule.startrail_active_steps``; ``active``, per sub-ring).
They are skipped, and so is their transfer: from one computed step s to the next s' each
rank sends the KV it holds straight to ``ring_shift(rank, s' - s)``, the rank that holds
it at s' in the full schedule; the placement goes straight to the holders at the first
computed step and dK/dV home from the holders at the last one (``placement_targets``,
``dkv_home_targets``, ... with ``active``). Every computed step sees the KV it sees in the
full schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal, get_args

Placement = Literal["team", "ring"] | tuple[int, ...]
ActiveSteps = tuple[tuple[int, ...], ...]
"""The sub-ring steps each sub-ring computes, ascending, indexed by
``StarTrailLayout.subring_index`` (``schedule.startrail_active_steps``)."""
PLACEMENTS: tuple[str, ...] = get_args(get_args(Placement)[0])
"""The named placements; a tuple map is the other kind (``StarTrailLayout``)."""
PLACEMENT_SETTINGS: tuple[str, ...] = (*PLACEMENTS, "auto")
"""What the adapters' placement setting takes: a named placement, or ``"auto"``, the map
``auto_placement.resolve_placement`` computes for the ranks' nodes."""


def placement_code(placement: Placement) -> int:
    """An integer naming a placement in agreement checks: 0 team, 1 ring, a map 2 + a
    64-bit FNV-1a hash of its ranks (ranks that disagree on a map see different codes)."""
    if isinstance(placement, str):
        return PLACEMENTS.index(placement)
    h = 0xCBF29CE484222325
    for r in placement:
        h = ((h ^ (r + 1)) * 0x100000001B3) % 2**64
    return 2 + h % (2**62)


def nodes_from_hosts(hosts) -> tuple[int, ...]:
    """Each rank's node number from its hostname, numbered in order of first appearance
    (``["b", "a", "b"]`` -> ``(0, 1, 0)``): what ``placement="auto"`` reads the CP group's
    nodes from."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(str(h), len(seen)) for h in hosts)


def check_placement(placement, cp_size: int) -> Placement:
    """``placement`` checked for ``cp_size`` CP ranks: a named one, or a map (a tuple or
    list of the CP ranks ``0 .. cp_size-1``, each once), returned as a tuple; else
    ``ValueError`` naming the setting and what is allowed."""
    if isinstance(placement, str):
        if placement not in PLACEMENTS:
            raise ValueError(
                f"placement={placement!r} is not known; allowed: {list(PLACEMENTS)} or a map "
                f"(a permutation of the {cp_size} CP ranks)"
            )
        return placement
    if isinstance(placement, (tuple, list)) and all(
        isinstance(r, int) and not isinstance(r, bool) for r in placement
    ):
        ranks = tuple(placement)
        if sorted(ranks) == list(range(cp_size)):
            return ranks
        raise ValueError(
            f"placement map {ranks} is not a permutation of the {cp_size} CP ranks "
            f"0..{cp_size - 1} (each once): the CP rank of logical rank team*C + member"
        )
    raise ValueError(
        f"placement={placement!r} is not known; allowed: {list(PLACEMENTS)} or a map (a tuple "
        f"of the {cp_size} CP ranks)"
    )


def divisors(n: int) -> list[int]:
    """Every d in 1 .. n dividing ``n`` (what a size that must divide ``n`` may be)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_team_sizes(cp_size: int) -> list[int]:
    """Every team size C with C*C dividing ``cp_size``."""
    return [c for c in range(1, cp_size + 1) if cp_size % (c * c) == 0]


def team_size_within(size: int, cap: int) -> int:
    """The largest team size that fits a group of ``size`` ranks and is at most ``cap``
    (a sub-group's team size from the run's ``--startrail-team-size``: 1, ring, where no
    larger one fits)."""
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"team size cap must be an integer >= 1, got {cap!r}")
    return max(c for c in valid_team_sizes(size) if c <= cap)


@dataclass(frozen=True)
class StarTrailLayout:
    """Where every CP rank sits in StarTrail's teams and sub-rings.

    Args:
        cp_size: P, the number of context-parallel ranks sharing one sequence.
        team_size: C, the replication factor; C*C must divide P.
            C = 1 is zigzag ring attention, C*C = P needs no ring at all.
        placement: ``"team"`` (team members adjacent), ``"ring"`` (sub-ring
            neighbours adjacent), or a map: a tuple of the P CP ranks, the CP rank of
            logical rank ``team*C + member`` at index ``team*C + member`` (module docstring).
    """

    cp_size: int
    team_size: int
    placement: Placement = "team"

    def __post_init__(self) -> None:
        p, c = self.cp_size, self.team_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"context-parallel size must be an integer >= 1, got {p!r}")
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"team_size must be an integer >= 1, got {c!r}")
        if p % (c * c) != 0:
            raise ValueError(
                f"team_size={c} does not fit context-parallel size {p}: team_size**2 must "
                f"divide it; allowed team sizes for {p}: {valid_team_sizes(p)}"
            )
        object.__setattr__(self, "placement", check_placement(self.placement, p))

    # ---- sizes -------------------------------------------------------------
    @property
    def num_teams(self) -> int:
        """T = P / C."""
        return self.cp_size // self.team_size

    @property
    def ring_size(self) -> int:
        """G = P / C^2: teams per team group, ranks per sub-ring, ring steps."""
        return self.cp_size // (self.team_size * self.team_size)

    # ---- coordinates -------------------------------------------------------
    def rank(self, team: int, member: int) -> int:
        """CP rank of (team, member) under this placement."""
        c, g_size = self.team_size, self.ring_size
        if not isinstance(self.placement, str):
            return self.placement[team * c + member]
        if self.placement == "team":
            return team * c + member
        group, pos = divmod(team, g_size)
        return group * c * g_size + member * g_size + pos

    def coord(self, rank: int) -> tuple[int, int]:
        """(team, member) of a CP rank."""
        return self._coords[rank]

    @cached_property
    def _coords(self) -> tuple[tuple[int, int], ...]:
        out: list[tuple[int, int]] = [(-1, -1)] * self.cp_size
        for t in range(self.num_teams):
            for a in range(self.team_size):
                out[self.rank(t, a)] = (t, a)
        return tuple(out)

    def team_group(self, team: int) -> int:
        return team // self.ring_size

    def team_ranks(self, team: int) -> list[int]:
        """CP ranks of a team, in member order (the order of team collectives)."""
        return [self.rank(team, a) for a in range(self.team_size)]

    def subring_ranks(self, group: int, member: int) -> list[int]:
        """CP ranks of sub-ring (group, member), in ring order."""
        g = self.ring_size
        return [self.rank(group * g + i, member) for i in range(g)]

    def all_team_ranks(self) -> list[list[int]]:
        return [self.team_ranks(t) for t in range(self.num_teams)]

    def all_subring_ranks(self) -> list[list[int]]:
        return [
            self.subring_ranks(g, a) for g in range(self.team_size) for a in range(self.team_size)
        ]

    # ---- peers -------------------------------------------------------------
    def _next_team(self, t: int, step: int = 1) -> int:
        g = self.ring_size
        return (t + step) % g + g * (t // g)

    def ring_next(self, rank: int) -> int:
        t, a = self.coord(rank)
        return self.rank(self._next_team(t), a)

    def ring_prev(self, rank: int) -> int:
        t, a = self.coord(rank)
        return self.rank(self._next_team(t, -1), a)

    def ring_shift(self, rank: int, hops: int) -> int:
        """The rank ``hops`` places after ``rank`` on its sub-ring (before it if negative):
        where the KV this rank holds at step s is held at step s + hops."""
        t, a = self.coord(rank)
        return self.rank(self._next_team(t, hops), a)

    def initial_send_peer(self, rank: int) -> int:
        """Where this rank sends its team's KV before the ring (paper, Alg. 2)."""
        t, a = self.coord(rank)
        c, g = self.team_size, self.ring_size
        return self.rank(a * g + t // c, t % c)

    def initial_recv_peer(self, rank: int) -> int:
        """Whose team KV this rank receives before the ring (inverse of the send)."""
        t, a = self.coord(rank)
        c, g = self.team_size, self.ring_size
        return self.rank(c * (t % g) + a, t // g)

    def kv_team_at_step(self, rank: int, step: int) -> int:
        """The KV team this rank computes against at ring step ``step``."""
        t, a = self.coord(rank)
        return self.team_size * ((t - step) % self.ring_size) + a

    def dkv_return_peers(self, rank: int) -> tuple[int, int]:
        """(send_to, recv_from) of the backward's final P2P.

        After step G-1 this rank holds the KV copy (and its dK/dV) that rank
        ``initial_recv_peer(ring_next(rank))`` sent; it returns it there, and
        receives its own copy from ``ring_prev(initial_send_peer(rank))``.
        """
        return (
            self.initial_recv_peer(self.ring_next(rank)),
            self.ring_prev(self.initial_send_peer(rank)),
        )

    def subring_index(self, rank: int) -> int:
        """The index of this rank's sub-ring in ``all_subring_ranks`` (group * C + member)."""
        t, a = self.coord(rank)
        return self.team_group(t) * self.team_size + a

    def computed_steps(self, rank: int, active: ActiveSteps | None) -> tuple[int, ...]:
        """The steps this rank's sub-ring computes: ``active[subring_index(rank)]``
        (``schedule.startrail_active_steps``), or all G when ``active`` is None."""
        if active is None:
            return tuple(range(self.ring_size))
        return active[self.subring_index(rank)]

    def _skip(self, rank: int, active: ActiveSteps | None, at_end: bool) -> int:
        """Steps idle before the first computed step of ``rank``'s sub-ring (or after its
        last one, ``at_end``): how far the KV copies move past them."""
        steps = self.computed_steps(rank, active)
        return self.ring_size - 1 - steps[-1] if at_end else steps[0]

    def placement_targets(self, rank: int, active: ActiveSteps | None = None) -> list[int]:
        """The C ranks that first hold a copy of this rank's team's KV, in copy order
        (copy ``a`` is the one ``initial_send_peer`` of member ``a`` gets): this rank
        sends its own K,V to each. ``active``: the steps each sub-ring computes
        (``schedule.startrail_active_steps``); a copy goes straight to the rank that
        holds it at its sub-ring's first computed step."""
        t, _ = self.coord(rank)
        base = [self.initial_send_peer(self.rank(t, a)) for a in range(self.team_size)]
        return [self.ring_shift(x, self._skip(x, active, False)) for x in base]

    def placement_sources(self, rank: int, active: ActiveSteps | None = None) -> list[int]:
        """The members, in member order, of the team whose KV this rank first holds (at its
        sub-ring's first computed step): it receives one local K,V from each and stacks
        them into the team's buffer."""
        held = self.ring_shift(rank, -self._skip(rank, active, False))  # its holder at step 0
        t, _ = self.coord(self.initial_recv_peer(held))
        return self.team_ranks(t)

    def dkv_home_targets(self, rank: int, active: ActiveSteps | None = None) -> list[int]:
        """The members, in member order, of the team whose KV copy (and dK/dV) this rank
        holds after its sub-ring's last computed step: each gets its own rows of the
        copy's dK/dV."""
        held = self.ring_shift(rank, self._skip(rank, active, True))  # its holder at step G-1
        t, _ = self.coord(self.dkv_return_peers(held)[0])
        return self.team_ranks(t)

    def dkv_home_sources(self, rank: int, active: ActiveSteps | None = None) -> list[int]:
        """The C ranks holding the copies of this rank's team's KV after their sub-rings'
        last computed steps, in copy order: each sends this rank its rows of that copy's
        dK/dV, summed here."""
        t, _ = self.coord(rank)
        out = []
        for a in range(self.team_size):
            x = self.dkv_return_peers(self.rank(t, a))[1]  # its holder at step G-1
            out.append(self.ring_shift(x, -self._skip(x, active, True)))
        return out

    # ---- data --------------------------------------------------------------
    def team_chunks(self, team: int) -> list[int]:
        """Zigzag chunk ids (of 2P) a team holds, sorted: its buffer order."""
        p = self.cp_size
        ids = [x for r in self.team_ranks(team) for x in (r, 2 * p - 1 - r)]
        return sorted(ids)

    def team_chunk_order(self, team: int) -> list[int]:
        """Permutation from the all-gathered member order to sorted-chunk order.

        The all-gather yields chunks ``[r0, 2P-1-r0, r1, 2P-1-r1, ...]``;
        ``gathered[perm]`` is in ascending chunk id order.
        """
        p = self.cp_size
        gathered = [x for r in self.team_ranks(team) for x in (r, 2 * p - 1 - r)]
        return sorted(range(len(gathered)), key=gathered.__getitem__)

    # ---- communication volume ---------------------------------------------
    def p2p_sends(
        self, rank: int, *, backward: bool, active: ActiveSteps | None = None
    ) -> dict[str, int]:
        """How many P2P messages this rank sends, by kind.

        ``active``: the steps each sub-ring computes (``None``: all G;
        ``schedule.startrail_active_steps`` under a sliding window, where KV is sent
        past the steps no rank of the sub-ring computes). ``kv`` and ``dkv``: team-sized
        (the team's K and V together, or their gradients), one per computed step but the
        last (``dkv`` backward only). ``kv_place``: local-sized pieces of the initial
        placement, one per ``placement_targets`` other than this rank (forward and
        backward); ``dkv_home``: local-sized dK/dV parts sent home, one per
        ``dkv_home_targets`` other than this rank (backward). Multiply by the tensor
        bytes to get bytes.
        """
        hops = len(self.computed_steps(rank, active)) - 1
        sends = {
            "kv": hops,
            "kv_place": sum(d != rank for d in self.placement_targets(rank, active)),
        }
        if backward:
            sends["dkv"] = hops
            sends["dkv_home"] = sum(d != rank for d in self.dkv_home_targets(rank, active))
        return sends
