"""One rank's part of a StarTrail attention call (torch; one idea per module).

- ``call``: ``RankCall``, the frozen record of the call (layout, rank, options, transports)
  and its dropout records.
- ``team_order``: member order <-> team-buffer order; a rank's real (non-padding) rows.
- ``kv_ring``: the K,V ring (placement, double-buffered steps, dK/dV home), one iterator
  for the forward and the backward.
- ``thd``: the THD gathers of variable-length kernel calls.
- ``kernel_calls``: one kernel call of the schedule in each direction.
- ``combine``: the forward's team combine by head groups, owning its accumulators.
- ``dkv``: the backward's dK/dV sum of one step.
- ``joint_keys``: MMDiT joint keys on the rank's own rows.
- ``forward``, ``backward``: the loops.

The autograd Function and the public ``startrail_attention`` are in ``attention.py``;
``one_process.py`` runs these per-rank functions for every rank in one process.
"""

from .backward import RankGrads, startrail_rank_backward
from .call import DropoutRecords, RankCall
from .forward import startrail_rank_forward
from .team_order import TeamOrder, real_rows

__all__ = [
    "DropoutRecords",
    "RankCall",
    "RankGrads",
    "TeamOrder",
    "real_rows",
    "startrail_rank_backward",
    "startrail_rank_forward",
]
