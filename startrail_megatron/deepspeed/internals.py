"""DeepSpeed's own objects that StarTrail uses (written against deepspeed 0.19.8).

``original_initialize`` is DeepSpeed's ``deepspeed.initialize``, captured when
this module is first imported (before any patch: ``patch.py`` imports it).
``hpz_group_ranks`` / ``set_hpz_group`` read and set DeepSpeed's (private,
module global) ZeRO++ hpZ group, which its ZeRO-3 reuses when set and
creates otherwise.
"""

from __future__ import annotations

import deepspeed

__all__ = ["hpz_group_ranks", "original_initialize", "set_hpz_group"]

original_initialize = deepspeed.initialize


def hpz_group_ranks() -> list[int] | None:
    """Global ranks of DeepSpeed's ZeRO-3 hierarchical-partition group of this rank, if any."""
    from deepspeed.utils import groups

    if groups._get_zero_param_intra_parallel_group() is None:
        return None
    return list(groups._get_zero_param_intra_parallel_group_ranks())


def set_hpz_group(group) -> None:
    """Make ``group`` DeepSpeed's ZeRO-3 hpZ group (``None``: let ZeRO-3 create its own).

    DeepSpeed keeps it in a module global that outlives an engine; a stale one
    would silently switch hpZ on for the next ZeRO-3 engine, so ``initialize``
    sets it every time."""
    from deepspeed.utils import groups

    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group
