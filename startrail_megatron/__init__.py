"""startrail_megatron: StarTrail concentric-ring sequence parallelism (arXiv 2407.00611).

Entry points:
  StarTrailGroups.create(team_size, cp_group=None, placement="team")  process groups
  UlyssesStarTrailGroups.create(ulysses_size, team_size, cp_group=None)  the 2-D split's
  startrail_attention(q, k, v, groups, *, causal=True, softmax_scale=None)  the attention
  zigzag_shard / zigzag_unshard                                        sequence layout
  pack_lengths, PackedLayout, shard_packed / unshard_packed            packed documents
  StarTrailLayout, UlyssesLayout                                       pure rank arithmetic
  CommLedger, accounting                                               communication accounting
  allgather_attention / ulysses_attention                             the peers (peers/)
  planner (subpackage)                                                 cost model, startrail-plan

The core imports neither Megatron nor DeepSpeed; their adapters live in
their own subpackages.
"""

import importlib

# The one place the version is written: setup.py reads it from this file (without importing
# the package), CHANGELOG.md lists its releases.
__version__ = "0.1.0"

# Names resolved on first use (PEP 562): importing a pure subpackage (``planner``,
# ``emulate``, ``schedule``) does not import torch, so ``startrail-plan`` and the
# emulation's parent start in a fraction of a second.
_LAZY = {
    "startrail_attention": ".attention",
    "CommEvent": ".comm",
    "CommLedger": ".comm",
    "StarTrailGroups": ".groups",
    "UlyssesStarTrailGroups": ".groups",
    "joint_attention": ".joint",
    "get_kernel": ".kernels",
    "merge_partial": ".kernels",
    "allgather_attention": ".peers",
    "ulysses_attention": ".peers",
    "PLACEMENTS": ".schedule.layout",
    "StarTrailLayout": ".schedule.layout",
    "valid_team_sizes": ".schedule.layout",
    "PackedLayout": ".schedule.packing",
    "pack_lengths": ".schedule.packing",
    "UlyssesLayout": ".schedule.ulysses",
    "shard_packed": ".zigzag",
    "unshard_packed": ".zigzag",
    "zigzag_shard": ".zigzag",
    "zigzag_unshard": ".zigzag",
}
_SUBMODULES = ("accounting", "joint", "peers")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = sorted([*_LAZY, *_SUBMODULES])
