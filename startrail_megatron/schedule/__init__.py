"""The StarTrail schedule: pure arithmetic (ints and dataclasses, no torch).

- ``layout``: ``StarTrailLayout``, teams, sub-rings, placements, the peer of every P2P
  (Note [the StarTrail schedule]).
- ``packing``: ``PackedLayout``, packed documents (Note [packed documents under StarTrail]).
- ``blocks``: the causal block plan of one (Q team, KV team) block (Note [causal balance]).
- ``calls``: ``RowCall`` s on team-buffer rows (dense, per packed document) and
  ``VarlenCall`` s grouped over documents; ``packed_team_order``.
- ``windows``: sliding-window band calls and the idle steps they leave.
- ``own_rows``: the rank's own query rows in its team's buffer, a step's calls cut there.
- ``policies``: head groups of the last step, the own-rows-first rule and its settings.
- ``step``: ``plan_step``, what rank r computes at step s: the attention and the planner
  both call it.
- ``allgather``: the all-gather-KV peer's calls.
- ``ulysses``: ``UlyssesLayout``, the 2-D split with head-parallel all-to-all
  (Note [the 2-D split]).
"""

from .allgather import allgather_calls
from .blocks import BlockCall, plan_block, startrail_step_calls, team_block_calls, team_chunk_len
from .calls import (
    RowCall,
    VarlenCall,
    band_pairs,
    packed_team_order,
    startrail_step_rows,
    startrail_step_varlen,
)
from .layout import PLACEMENTS, ActiveSteps, Placement, StarTrailLayout, valid_team_sizes
from .own_rows import OwnCall, OwnRun, own_team_rows, restrict_rows, split_own_rows
from .packing import PackedLayout, pack_lengths
from .policies import (
    ALL_HEADS,
    OWN_ROWS_FIRST_SETTINGS,
    check_own_rows_first,
    own_rows_first_pays,
    splits_first_step,
    tail_head_groups,
)
from .step import StepPlan, check_head_chunks_setting, check_tile, plan_step, tile_calls
from .windows import (
    band_call,
    buffer_chunks,
    normalize_window,
    offset_band,
    startrail_active_steps,
    startrail_step_packed_window_rows,
    startrail_step_window_rows,
)

__all__ = [
    "PLACEMENTS",
    "ActiveSteps",
    "PackedLayout",
    "Placement",
    "StarTrailLayout",
    "pack_lengths",
    "valid_team_sizes",
    "ALL_HEADS",
    "OWN_ROWS_FIRST_SETTINGS",
    "BlockCall",
    "OwnCall",
    "OwnRun",
    "RowCall",
    "StepPlan",
    "check_head_chunks_setting",
    "check_tile",
    "VarlenCall",
    "allgather_calls",
    "band_call",
    "band_pairs",
    "buffer_chunks",
    "check_own_rows_first",
    "normalize_window",
    "offset_band",
    "own_rows_first_pays",
    "own_team_rows",
    "packed_team_order",
    "plan_block",
    "plan_step",
    "tile_calls",
    "restrict_rows",
    "split_own_rows",
    "splits_first_step",
    "startrail_active_steps",
    "startrail_step_calls",
    "startrail_step_packed_window_rows",
    "startrail_step_rows",
    "startrail_step_varlen",
    "startrail_step_window_rows",
    "tail_head_groups",
    "team_block_calls",
    "team_chunk_len",
]
