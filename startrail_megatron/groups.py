"""StarTrail's process groups, built from the pure layout over a CP group (and the 2-D
split's: ``UlyssesStarTrailGroups``)."""

from __future__ import annotations

import functools
import inspect
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .schedule import check_own_rows_first
from .schedule.layout import Placement, StarTrailLayout
from .schedule.ulysses import UlyssesLayout

__all__ = ["StarTrailGroups", "UlyssesStarTrailGroups", "group_timeout"]


@functools.cache
def _new_group_sorts() -> bool:
    """Whether ``dist.new_group`` takes ``sort_ranks`` (newer torch; older ones always sort)."""
    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def _new_group(ranks: list[int], timeout: timedelta | None, desc: str) -> dist.ProcessGroup:
    """A group whose rank order is ``ranks`` as listed (member order, ring order).

    torch sorts the ranks of a new group unless told not to (``sort_ranks``, recent
    torch only). The layouts list them ascending whenever the CP group's global ranks
    ascend, so older torch is fine then; otherwise the order would be silently wrong,
    so it is refused.
    """
    if _new_group_sorts():
        return dist.new_group(ranks, timeout=timeout, sort_ranks=False, group_desc=desc)
    if ranks != sorted(ranks):
        raise ValueError(
            f"StarTrail group {desc} needs global ranks in the order {ranks}, but this torch "
            f"({torch.__version__}) sorts a new group's ranks (no sort_ranks argument): give "
            "a cp_group whose global ranks ascend with the CP rank"
        )
    return dist.new_group(ranks, timeout=timeout, group_desc=desc)


def group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout ``group`` was created with (``None`` if this torch does not say).

    ``dist.new_group(timeout=None)`` takes torch's 30-minute default, not the timeout of
    the world or of the CP group; StarTrail's groups inherit the CP group's instead, so a
    dead or mismatched peer ends in an error at the timeout the user configured. Read
    through the backend's options (a private attribute; best effort).
    """
    pg = group if group is not None else dist.group.WORLD
    devices = ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]
    for dev in devices:
        try:
            t = pg._get_backend(torch.device(dev)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for this device, or another torch
            continue
        if isinstance(t, timedelta):
            return t
    return None


def _agree_on_setting(
    cp_group: dist.ProcessGroup | None, cp_size: int, setting: tuple, what: str
) -> tuple[tuple[int, ...], list]:
    """Every rank's CP group (global ranks), setting and hostname, by one small all-gather
    over the world: ranks that disagree would create different groups and hang, so they
    all raise the same ``ValueError`` instead (naming ``what``). Returns this rank's CP
    group's global ranks and, per world rank, ``(cp ranks, setting, hostname)``."""
    if cp_group is None:
        mine = tuple(range(cp_size))
    else:
        mine = tuple(dist.get_global_rank(cp_group, r) for r in range(cp_size))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, setting, socket.gethostname()))
    if any(len(g[0]) != cp_size for g in gathered):
        raise ValueError(
            f"every rank's cp_group must have the same size; got sizes "
            f"{sorted({len(g[0]) for g in gathered})}"
        )
    settings = sorted({g[1] for g in gathered}, key=repr)
    if len(settings) > 1:
        raise ValueError(f"the ranks disagree on {what}: {settings}; every rank must pass the same")
    return mine, gathered


def every_cp_group(
    cp_group: dist.ProcessGroup | None, setting: tuple, what: str
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """This rank's CP group and every CP group of the world (global ranks, sorted), by one
    small all-gather over the world; every rank calls it at the same point. Ranks that pass
    different ``setting`` all raise the same ``ValueError`` naming ``what``. For making
    groups inside each CP group: every rank then makes every group in the same order."""
    mine, gathered = _agree_on_setting(cp_group, dist.get_world_size(cp_group), setting, what)
    return mine, sorted({g[0] for g in gathered})


def _warm_up_device(
    backend: str, cuda_available: bool, bound: torch.device | None = None, current: int = 0
) -> str:
    """The device of the warm-up tensor for a group of ``backend`` (e.g. ``"nccl"``,
    ``"gloo"``, ``"cpu:gloo,cuda:nccl"``): a CUDA device when the group has NCCL (the
    group's bound device, from ``init_process_group(device_id=...)``, else the current
    one), else the CPU."""
    if not (cuda_available and "nccl" in backend):
        return "cpu"
    if bound is not None and bound.type == "cuda":
        return str(bound)
    return f"cuda:{current}"


def _warm_up(group: dist.ProcessGroup | None) -> None:
    """One tiny all-reduce on ``group``, so that its first operation involves every rank.

    torch requires that a ``batch_isend_irecv`` which is a group's first operation be
    joined by all its ranks (NCCL builds the communicator then); StarTrail's first use
    of the CP group is the initial KV placement, which skips the ranks that keep their
    own KV. Doing this here also surfaces a broken communicator at setup, not mid-step.
    """
    cuda = torch.cuda.is_available()
    pg = group if group is not None else dist.group.WORLD
    dev = _warm_up_device(
        dist.get_backend(group),
        cuda,
        getattr(pg, "bound_device_id", None),
        torch.cuda.current_device() if cuda else 0,
    )
    dist.all_reduce(torch.zeros(1, device=dev), group=group)


@dataclass(frozen=True)
class StarTrailGroups:
    """The groups one CP rank uses, created once and passed explicitly.

    Attributes:
        layout: the pure rank arithmetic (P, C, placement).
        cp_group: the context-parallel group (``None`` = the default world).
        cp_rank: this rank's index in ``cp_group``.
        team_group: the C ranks of this rank's team (``None`` when C = 1).
        subring_group: the G ranks of this rank's sub-ring (``None`` when G = 1).
        team_hosts: how many hosts (``socket.gethostname``) this rank's team spans: the
            default of ``CommOptions(own_rows_first=)`` reads it.
        own_rows_first: the adapter's own-rows-first setting (Megatron's
            ``--startrail-own-rows-first``, DeepSpeed's ``startrail.own_rows_first``):
            what a call whose ``CommOptions(own_rows_first=None)`` does; ``None`` (auto):
            ``$STARTRAIL_OWN_ROWS_FIRST``, else the rule (``attention.py``'s Note).
        agreed: the call settings the CP ranks were checked to agree on
            (``startrail_attention`` fills it, once per new setting).
    """

    layout: StarTrailLayout
    cp_group: dist.ProcessGroup | None
    cp_rank: int
    team_group: dist.ProcessGroup | None
    subring_group: dist.ProcessGroup | None
    team_hosts: int = 1
    own_rows_first: bool | None = None
    agreed: set = field(default_factory=set, repr=False, compare=False)

    @property
    def team_size(self) -> int:
        return self.layout.team_size

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @classmethod
    def create(
        cls,
        team_size: int,
        cp_group: dist.ProcessGroup | None = None,
        placement: Placement = "team",
        *,
        timeout: timedelta | None = None,
        own_rows_first: bool | None = None,
    ) -> StarTrailGroups:
        """Build the team and sub-ring groups over ``cp_group`` (a collective call).

        Like Megatron's own group creation, every rank of the default world
        must call this, with the same arguments, at the same point: when
        ``cp_group`` is one of several CP groups (one per data-parallel
        replica, say), the ranks first exchange their CP groups' members
        (one small all-gather) and then every rank creates every group of
        every CP group in the same order; each rank ends with one tiny
        all-reduce on each group it uses (the CP group's first operation must
        involve all its ranks, which the initial KV placement does not). On
        GPUs, set each rank's CUDA device first (``torch.cuda.set_device`` or
        ``init_process_group(device_id=...)``), as NCCL requires anyway.
        ``timeout`` applies to the new groups (default: the CP group's own
        timeout, so a dead peer fails at the timeout the user configured, not
        at torch's 30-minute default for new groups). The setting is checked
        before any communication; ranks that pass different settings all raise
        the same ``ValueError``. ``own_rows_first``: the ``own_rows_first`` attribute
        (True, False or None), rank-local.
        """
        check_own_rows_first(own_rows_first)
        if not dist.is_initialized():
            raise RuntimeError("StarTrailGroups.create needs torch.distributed to be initialized")
        cp_size = dist.get_world_size(cp_group)
        layout = StarTrailLayout(cp_size, team_size, placement)  # ValueError on a bad setting
        cp_rank = dist.get_rank(cp_group)
        if timeout is None:
            timeout = group_timeout(cp_group)
        mine, gathered = _agree_on_setting(
            cp_group, cp_size, (team_size, placement), "StarTrail's (team_size, placement)"
        )
        all_cp = sorted({g[0] for g in gathered})

        team, member = layout.coord(cp_rank)
        team_group = subring_group = None
        for cp_ranks in all_cp:
            ours = cp_ranks == mine
            if layout.team_size > 1:
                for t in range(layout.num_teams):
                    g = _new_group(  # group rank order = member order
                        [cp_ranks[r] for r in layout.team_ranks(t)], timeout, f"startrail_team_{t}"
                    )
                    if ours and t == team:
                        team_group = g
            if layout.ring_size > 1:
                for gi in range(layout.team_size):
                    for a in range(layout.team_size):
                        g = _new_group(  # group rank order = ring order
                            [cp_ranks[r] for r in layout.subring_ranks(gi, a)],
                            timeout,
                            f"startrail_subring_{gi}_{a}",
                        )
                        if ours and (gi, a) == (layout.team_group(team), member):
                            subring_group = g
        # One all-reduce on every group this rank uses, in the same order on every rank.
        used = [cp_group] if cp_size > 1 else []
        used += [g for g in (team_group, subring_group) if g is not None]
        for g in used:
            _warm_up(g)
        hosts = {gathered[mine[r]][2] for r in layout.team_ranks(team)}
        return cls(layout, cp_group, cp_rank, team_group, subring_group, len(hosts), own_rows_first)


@dataclass(frozen=True)
class UlyssesStarTrailGroups:
    """The groups of the 2-D split (``schedule/ulysses.py``'s Note [the 2-D split]):
    head-parallel all-to-all over U consecutive CP ranks, StarTrail over the R = P / U
    ranks holding the same heads. ``startrail_attention`` takes it in place of a
    ``StarTrailGroups``.

    Attributes:
        layout: the pure rank arithmetic (P, U, C, placement).
        cp_group: the context-parallel group (``None`` = the default world).
        cp_rank: this rank's index in ``cp_group``.
        ulysses_group: the U ranks of this rank's Ulysses group, member order.
        startrail: StarTrail's groups over this rank's ring group (R ranks).
        agreed: the call settings the CP ranks were checked to agree on.
    """

    layout: UlyssesLayout
    cp_group: dist.ProcessGroup | None
    cp_rank: int
    ulysses_group: dist.ProcessGroup | None
    startrail: StarTrailGroups
    agreed: set = field(default_factory=set, repr=False, compare=False)

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @property
    def team_size(self) -> int:
        return self.layout.team_size

    @property
    def ulysses_size(self) -> int:
        return self.layout.ulysses_size

    @property
    def ulysses_rank(self) -> int:
        """This rank's member index in its Ulysses group (its head shard)."""
        return self.layout.coord(self.cp_rank)[1]

    @property
    def own_rows_first(self) -> bool | None:
        return self.startrail.own_rows_first

    @classmethod
    def create(
        cls,
        ulysses_size: int,
        team_size: int,
        cp_group: dist.ProcessGroup | None = None,
        placement: Placement = "team",
        *,
        timeout: timedelta | None = None,
        own_rows_first: bool | None = None,
    ) -> UlyssesStarTrailGroups:
        """Build the Ulysses and ring groups over ``cp_group``, then StarTrail's groups over
        the ring group (a collective call, as ``StarTrailGroups.create``: every rank of the
        default world calls it with the same arguments at the same point). A bad setting
        is a ``ValueError`` before any communication; ranks that pass different settings
        all raise the same ``ValueError``."""
        check_own_rows_first(own_rows_first)
        if not dist.is_initialized():
            raise RuntimeError(
                "UlyssesStarTrailGroups.create needs torch.distributed to be initialized"
            )
        cp_size = dist.get_world_size(cp_group)
        layout = UlyssesLayout(cp_size, ulysses_size, team_size, placement)  # ValueError
        cp_rank = dist.get_rank(cp_group)
        if timeout is None:
            timeout = group_timeout(cp_group)
        mine, gathered = _agree_on_setting(
            cp_group, cp_size, (ulysses_size, team_size, placement),
            "(ulysses_size, team_size, placement)",
        )  # fmt: skip
        ring_rank, member = layout.coord(cp_rank)
        ring_group = ulysses_group = None
        for cp_ranks in sorted({g[0] for g in gathered}):
            ours = cp_ranks == mine
            for u in range(layout.ulysses_size):
                g = _new_group(
                    [cp_ranks[r] for r in layout.ring_ranks(u)], timeout, f"startrail_ring_{u}"
                )
                if ours and u == member:
                    ring_group = g
            for r in range(layout.ring_size):
                g = _new_group(
                    [cp_ranks[x] for x in layout.ulysses_ranks(r)], timeout, f"ulysses_{r}"
                )
                if ours and r == ring_rank:
                    ulysses_group = g
        if layout.ulysses_size > 1:
            _warm_up(ulysses_group)
        startrail = StarTrailGroups.create(
            team_size, ring_group, placement, timeout=timeout, own_rows_first=own_rows_first
        )
        return cls(layout, cp_group, cp_rank, ulysses_group, startrail)
