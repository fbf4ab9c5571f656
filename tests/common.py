"""Shared pieces of the multi-rank tests: tolerances, cached groups, and the package's one
float64 reference (``startrail_megatron.testing``) under the names the tests use."""

from __future__ import annotations

import torch

import startrail_megatron as st
from startrail_megatron.testing import make_inputs, rel_err, shard, unshard
from startrail_megatron.testing import reference_attention as reference

__all__ = ["TOL", "groups_for", "make_inputs", "reference", "rel_err", "shard", "unshard"]

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
_GROUPS: dict = {}


def groups_for(team_size: int, placement: str = "team", cp_group=None, key=None):
    """Per-process cache: groups live as long as the pool's process group."""
    k = (team_size, placement, key)
    if k not in _GROUPS:
        _GROUPS[k] = st.StarTrailGroups.create(team_size, cp_group=cp_group, placement=placement)
    return _GROUPS[k]
