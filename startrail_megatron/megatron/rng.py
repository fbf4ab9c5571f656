"""The random number generators a training step draws from, as one value per rank.

Dropout draws from megatron-core's RNG tracker (``model-parallel-rng``, under
``tensor_parallel.get_cuda_rng_tracker().fork()``) and from torch's default generators
(the hidden dropout outside the fork); a rank's draws depend on its local shapes, so ranks
of per-batch layouts end in different states. ``capture()`` takes this rank's, ``restore``
puts them back: a checkpoint keeps them (a resumed run with dropout draws the masks the
uninterrupted one would: our entry point's checkpoints and, for a Megatron GPT, DeepSpeed's
``save_checkpoint``), and ``--startrail-team-size auto``'s trials leave them as they found
them.
"""

from __future__ import annotations

import sys

import torch

from ..checkpoint_files import generator_states, restore_generators

__all__ = ["capture", "restore", "tracker_in_use"]


def tracker_in_use() -> bool:
    """Whether megatron-core's RNG tracker holds states in this process (a Megatron model
    draws its attention dropout from it); asked without importing megatron-core."""
    mod = sys.modules.get("megatron.core.tensor_parallel.random")
    return mod is not None and bool(mod.get_cuda_rng_tracker().get_states())


def _tracker():
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom.get_cuda_rng_tracker()


def capture() -> dict:
    """This rank's generator states (copies): torch's (``checkpoint_files.
    generator_states``) and each state of megatron-core's RNG tracker."""
    tracker = _tracker().get_states()
    odd = [k for k, v in tracker.items() if not isinstance(v, torch.Tensor)]
    if odd:  # graph-safe generators (use_cudagraphable_rng), which this entry point never makes
        raise ValueError(f"RNG tracker states {odd} are not tensors; they cannot be kept")
    return {**generator_states(), "tracker": {k: v.clone() for k, v in tracker.items()}}


def restore(state: dict) -> None:
    """Put back what ``capture`` took."""
    restore_generators(state)
    _tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})
