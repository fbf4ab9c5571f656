"""The one patch of DeepSpeed's module namespace: ``deepspeed.initialize``, opt-in.

``patch()`` makes ``deepspeed.initialize`` StarTrail-aware (``entry.initialize``:
a config without an enabled ``"startrail"`` section goes to DeepSpeed untouched);
``unpatch()`` restores the original (``internals.original_initialize``);
``with patched():`` does both around a block. Nothing is patched on import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import deepspeed

from . import internals
from .entry import initialize

__all__ = ["is_patched", "patch", "patched", "unpatch"]


def is_patched() -> bool:
    return deepspeed.initialize is not internals.original_initialize


def patch() -> None:
    """Route ``deepspeed.initialize`` through ``startrail_megatron.deepspeed.initialize``."""
    deepspeed.initialize = initialize


def unpatch() -> None:
    deepspeed.initialize = internals.original_initialize


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
