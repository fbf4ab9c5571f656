"""Set-up and teardown of a run: Megatron's parallel state, StarTrail's groups, seeds.

``initialize(args)`` points megatron-core's CUDA-only spots at the CPU on
machines without CUDA (``cpu_support``), installs StarTrail's hooks for
``--context-parallel-impl startrail`` (``hooks.install``), builds Megatron's
parallel state (and with it StarTrail's groups) and seeds the RNG trackers;
``teardown()`` destroys the parallel state and uninstalls the hooks.
"""

from __future__ import annotations

import argparse

from ..arguments import install_from_args
from ..cpu_support import cpu_manual_seed, enable_cpu_support
from ..hooks import uninstall

__all__ = ["initialize", "teardown"]


def initialize(args: argparse.Namespace) -> None:
    """Megatron's parallel state (plus StarTrail's groups when enabled) and seeds."""
    from megatron.core import parallel_state

    on_cpu = enable_cpu_support()
    install_from_args(args)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    if on_cpu:
        cpu_manual_seed(args.seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)


def teardown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    uninstall()
