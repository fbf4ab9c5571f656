"""The process groups DeepSpeed gets: an mpu in the style of its sequence-parallel state.

DeepSpeed's own ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` is a
module with ``initialize_sequence_parallel``, ``get_sequence_parallel_*`` and
``get_sequence_data_parallel_*``; DeepSpeed recognises a sequence-parallel mpu
by the presence of ``initialize_sequence_parallel`` (then it takes no tensor
parallel group from it, partitions ZeRO over ``get_sequence_data_parallel_group``
and divides reduced gradients by (sequence x data) / sequence = data ranks).
``StarTrailMPU`` has exactly that interface, with StarTrail's whole
context-parallel group as the sequence-parallel group.

Rank order (world W, P = sequence_parallel_size, D = W / P data replicas)::

    global rank = d * P + cp_rank          sequence groups  [d*P, (d+1)*P)
                                            ZeRO group       all W ranks

so with ``placement="team"`` a StarTrail team is C contiguous global ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from ..auto_placement import resolve_placement
from ..batch_attention import BatchGroups
from ..groups import StarTrailGroups, UlyssesStarTrailGroups, group_timeout
from .config import StarTrailConfig

__all__ = ["StarTrailMPU"]


@dataclass(frozen=True)
class StarTrailMPU:
    """Sequence-parallel state handed to ``deepspeed.initialize(mpu=...)``.

    Attributes:
        config: the validated ``"startrail"`` section.
        sequence_parallel_group: this rank's StarTrail CP group (P ranks).
        sequence_data_parallel_group: the ZeRO group, sequence x data (all ranks).
        startrail: the team / sub-ring groups over ``sequence_parallel_group`` (with
            ``startrail.ulysses_size`` > 1 the 2-D split's ``UlyssesStarTrailGroups``).
        data_parallel_rank, data_parallel_size: this rank's replica d and D
            (use them to shard data over replicas; the P ranks of a replica
            need the same batch).
        batch_groups: with ``startrail.hybrid_context_parallel``, StarTrail's groups of
            every aligned sub-group of the P ranks (``BatchGroups``); else None.
        batch_schedule: with ``startrail.hybrid_context_parallel``, what places each
            batch's documents (``hybrid.HybridSchedule``; ``initialize`` sets it from the
            model); else None.
    """

    config: StarTrailConfig
    sequence_parallel_group: dist.ProcessGroup
    sequence_data_parallel_group: dist.ProcessGroup
    startrail: StarTrailGroups | UlyssesStarTrailGroups
    data_parallel_rank: int
    data_parallel_size: int
    batch_groups: BatchGroups | None = field(default=None, repr=False)
    batch_schedule: object = field(default=None, repr=False)

    @classmethod
    def create(cls, config: StarTrailConfig) -> StarTrailMPU:
        """Create every group (collective over the default world, same order on every rank).

        On CUDA the current device must already be this rank's (``initialize`` sets it,
        ``entry.set_local_device``): the groups communicate once when created."""
        if not dist.is_initialized():
            raise RuntimeError("StarTrailMPU.create needs torch.distributed to be initialized")
        world, rank = dist.get_world_size(), dist.get_rank()
        config.check_world(world)
        p = config.sequence_parallel_size
        # the world's timeout (deepspeed.init_distributed(timeout=)), not torch's 30-minute
        # default for a new group: a dead or stalled peer ends in an error when configured
        timeout = group_timeout(None)
        mine = None
        for d in range(world // p):
            ranks = list(range(d * p, (d + 1) * p))
            g = dist.new_group(ranks, timeout=timeout, group_desc=f"startrail_sp_{d}")
            if d == rank // p:
                mine = g
        seq_data = dist.new_group(list(range(world)), timeout=timeout, group_desc="startrail_sp_dp")
        # "auto": the map for these ranks' nodes (a collective over the world)
        placement = resolve_placement(
            config.placement, config.team_size, mine, ulysses_size=config.ulysses_size
        )
        kw = dict(cp_group=mine, placement=placement)
        kw["own_rows_first"] = config.own_rows_first_value
        if config.ulysses_size > 1:
            groups = UlyssesStarTrailGroups.create(config.ulysses_size, config.team_size, **kw)
        else:
            groups = StarTrailGroups.create(config.team_size, **kw)
        batch = None
        if config.hybrid_context_parallel:
            batch = BatchGroups.create(mine, timeout=timeout, own_rows_first=kw["own_rows_first"])
        return cls(config, mine, seq_data, groups, rank // p, world // p, batch)

    # ---- DeepSpeed's sequence-parallel mpu interface ------------------------
    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """Present so DeepSpeed treats this as a sequence-parallel mpu; groups exist already."""
        if sequence_parallel_size != self.config.sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_size={sequence_parallel_size} differs from "
                f"startrail.sequence_parallel_size={self.config.sequence_parallel_size}"
            )

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.sequence_parallel_group

    def get_sequence_parallel_world_size(self) -> int:
        return dist.get_world_size(self.sequence_parallel_group)

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self.sequence_parallel_group)

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.sequence_data_parallel_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.sequence_data_parallel_group)

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.sequence_data_parallel_group)

    # DeepSpeed's parallel_state_sp aliases model parallel to sequence parallel.
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank
