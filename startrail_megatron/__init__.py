"""startrail_megatron: StarTrail concentric-ring sequence parallelism (arXiv 2407.00611).

Entry points:
  StarTrailGroups.create(team_size, cp_group=None, placement="team")  process groups
  UlyssesStarTrailGroups.create(ulysses_size, team_size, cp_group=None)  the 2-D split's
  startrail_attention(q, k, v, groups, *, causal=True, softmax_scale=None)  the attention
  zigzag_shard / zigzag_unshard                                        sequence layout
  pack_lengths, PackedLayout, shard_packed / unshard_packed            packed documents
  StarTrailLayout, UlyssesLayout                                       pure rank arithmetic
  CommLedger                                                           communication accounting
  allgather_attention / ulysses_attention                             the peers (peers/)
  planner (subpackage)                                                 cost model, startrail-plan

The core imports neither Megatron nor DeepSpeed; their adapters live in
their own subpackages.
"""

from . import joint, peers
from .attention import startrail_attention
from .comm import CommEvent, CommLedger
from .groups import StarTrailGroups, UlyssesStarTrailGroups
from .joint import joint_attention
from .kernels import get_kernel, merge_partial
from .peers import allgather_attention, ulysses_attention
from .schedule.layout import PLACEMENTS, StarTrailLayout, valid_team_sizes
from .schedule.packing import PackedLayout, pack_lengths
from .schedule.ulysses import UlyssesLayout
from .zigzag import shard_packed, unshard_packed, zigzag_shard, zigzag_unshard

__version__ = "0.1.0"

__all__ = [
    "CommEvent",
    "CommLedger",
    "PLACEMENTS",
    "PackedLayout",
    "StarTrailGroups",
    "StarTrailLayout",
    "UlyssesLayout",
    "UlyssesStarTrailGroups",
    "allgather_attention",
    "get_kernel",
    "joint",
    "joint_attention",
    "merge_partial",
    "pack_lengths",
    "peers",
    "shard_packed",
    "startrail_attention",
    "ulysses_attention",
    "unshard_packed",
    "valid_team_sizes",
    "zigzag_shard",
    "zigzag_unshard",
]
