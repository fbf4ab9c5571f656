"""The one place that touches DeepSpeed's module namespace (written against deepspeed 0.19.8).

``patch()`` makes ``deepspeed.initialize`` StarTrail-aware (``entry.initialize``:
a config without an enabled ``"startrail"`` section goes to DeepSpeed untouched);
``unpatch()`` restores the original. Opt-in: nothing is patched on import.
``original_initialize`` is DeepSpeed's own function, whatever the patch state.
``hpz_group_ranks`` / ``set_hpz_group`` read and set DeepSpeed's (private, module
global) ZeRO++ hpZ group, which its ZeRO-3 reuses when set and creates otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import deepspeed

__all__ = [
    "hpz_group_ranks",
    "set_hpz_group",
    "is_patched",
    "original_initialize",
    "patch",
    "patched",
    "unpatch",
]

original_initialize = deepspeed.initialize
if getattr(original_initialize, "_startrail_patch", False):  # pragma: no cover - reload safety
    original_initialize = original_initialize.__wrapped__


def is_patched() -> bool:
    return deepspeed.initialize is not original_initialize


def patch() -> None:
    """Route ``deepspeed.initialize`` through ``startrail_megatron.deepspeed.initialize``."""
    from .entry import initialize

    deepspeed.initialize = initialize


def unpatch() -> None:
    deepspeed.initialize = original_initialize


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """``with patched():`` StarTrail-aware ``deepspeed.initialize`` inside the block only."""
    was = is_patched()
    patch()
    try:
        yield
    finally:
        if not was:
            unpatch()


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
