"""``RankCall``: the frozen record of one rank's part in one attention call.

Built once per call (``RankCall.over_groups`` on ``torch.distributed`` groups, or
directly by ``one_process.py`` over the in-process transport) and read by the forward
and the backward of that call. It holds what the call is (layout, rank, causal mask,
packed documents, checked options, the own-rows-first setting) and the two transports
the schedule runs on (``comm/protocols.py``); nothing in it changes during the call but
the dropout records, which the forward writes and the backward replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..comm import (
    DEFAULT_COMM,
    CommLedger,
    CommOptions,
    P2PComm,
    PeerExchange,
    TeamCollectives,
    TeamComm,
)
from ..groups import StarTrailGroups
from ..kernels import AttentionKernel, Dropout, has_varlen
from ..schedule import StepPlan, plan_step, splits_first_step, startrail_active_steps
from ..schedule.layout import ActiveSteps, StarTrailLayout
from ..schedule.packing import PackedLayout
from ..validation import NO_OPTIONS, AttnOptions
from .team_order import TeamOrder

__all__ = ["DropoutRecords", "RankCall"]


class DropoutRecords:
    """One attention-dropout record per kernel call, keyed by (step, call): the forward
    draws each (``Dropout``: the RNG state its mask came from), the backward gets the
    same one back. Without dropout every call gets ``None``."""

    def __init__(self, p: float):
        self.p = p
        self._records: dict[tuple[int, int], Dropout] = {}

    def at(self, step: int, call: int) -> Dropout | None:
        if not self.p:
            return None
        rec = self._records.get((step, call))
        if rec is None:
            rec = self._records[step, call] = Dropout(self.p)
        return rec


@dataclass(frozen=True)
class RankCall:
    """One rank's attention call: what it is and the transports it runs on.

    ``team_comm`` / ``p2p``: the team collectives and the peer exchanges
    (``comm/protocols.py``); ``subring_group``: the group the sub-ring exchanges name
    (``None`` in one process). ``packed``: the documents of a packed sequence
    (``packing.py``), or ``None``. ``options``: the checked ``AttnOptions`` (dropout,
    normalized window, soft-capping). ``own_rows_first``: the call's setting (True,
    False, or None for the rule, ``schedule.splits_first_step``), with ``team_hosts``
    (how many hosts the rank's team spans) for the rule.
    """

    layout: StarTrailLayout
    rank: int
    causal: bool
    team_comm: TeamCollectives
    p2p: PeerExchange
    subring_group: Any = None
    packed: PackedLayout | None = None
    options: AttnOptions = NO_OPTIONS
    own_rows_first: bool | None = None
    team_hosts: int = 1
    dropouts: DropoutRecords = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dropouts", DropoutRecords(self.options.dropout_p))

    @classmethod
    def over_groups(
        cls,
        groups: StarTrailGroups,
        causal: bool,
        ledger: CommLedger | None,
        *,
        packed: PackedLayout | None = None,
        options: AttnOptions = NO_OPTIONS,
        comm_options: CommOptions = DEFAULT_COMM,
    ) -> RankCall:
        """The call on ``torch.distributed`` groups (``TeamComm``, ``P2PComm``)."""
        lay = groups.layout
        return cls(
            layout=lay,
            rank=groups.cp_rank,
            causal=causal,
            team_comm=TeamComm(groups.team_group, lay.team_size, ledger, comm_options),
            p2p=P2PComm(groups.cp_group, groups.cp_rank, ledger, comm_options),
            subring_group=groups.subring_group,
            packed=packed,
            options=options,
            own_rows_first=comm_options.own_rows_first,
            team_hosts=groups.team_hosts,
        )

    @cached_property
    def team(self) -> int:
        return self.layout.coord(self.rank)[0]

    @cached_property
    def member(self) -> int:
        return self.layout.coord(self.rank)[1]

    @cached_property
    def team_order(self) -> TeamOrder:
        """Member order <-> this rank's team-buffer order, shared by forward and backward."""
        return TeamOrder(self.layout, self.team, self.member, self.causal, self.packed)

    def active_steps(self, s_local: int) -> ActiveSteps | None:
        """The steps each sub-ring computes (``schedule.startrail_active_steps``): all G
        (``None``), but under a sliding window the steps idle on every rank of a sub-ring
        are skipped and their K,V sent past them."""
        packed = self.packed
        return startrail_active_steps(
            self.layout, self.causal, s_local if packed is None else packed.s_local,
            self.options.window, packed,
        )  # fmt: skip

    def splits_first_step(self, heads_q: int, heads_kv: int) -> bool:
        """Whether the first computed step runs its own rows' calls first
        (``schedule.splits_first_step``)."""
        return splits_first_step(
            self.layout, packed=self.packed is not None, dropout=bool(self.options.dropout_p),
            setting=self.own_rows_first, heads_q=heads_q, heads_kv=heads_kv,
            team_hosts=self.team_hosts,
        )  # fmt: skip

    def plan(self, step: int, s_local: int, kernel: AttentionKernel, own_first: bool) -> StepPlan:
        """This rank's calls at ``step`` (``schedule.plan_step``), cut into the options'
        tiles."""
        return plan_step(
            self.layout, self.rank, step, causal=self.causal, s_local=s_local,
            packed=self.packed, window=self.options.window, varlen=has_varlen(kernel),
            own_first=own_first, tile=self.options.tile,
        )  # fmt: skip
