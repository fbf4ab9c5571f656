"""Set-up and teardown of a run: Megatron's parallel state, StarTrail's groups, seeds.

``initialize(args)`` changes the process, and ``teardown()`` undoes each change:

* on machines without CUDA, megatron-core's CUDA-only spots point at the CPU
  (``cpu_support.enable_cpu_support``; undone by ``disable_cpu_support``);
* with ``--context-parallel-impl startrail``, StarTrail's hooks into megatron-core
  (``hooks.install``; undone by ``hooks.uninstall``);
* Megatron's parallel state and, through the hooks, StarTrail's groups
  (``initialize_model_parallel``; undone by ``destroy_model_parallel``, which
  the hooks make release StarTrail's groups and their communicators);
* the RNG trackers' seeds;
* processes forked from the rank die with it (``spawn.forks_die_with_their_parent``; not
  undone: once per process).

If ``initialize`` fails, it undoes what it did before raising.
"""

from __future__ import annotations

import argparse

from ...spawn import forks_die_with_their_parent
from ..arguments import install_from_args
from ..cpu_support import cpu_manual_seed, disable_cpu_support, enable_cpu_support
from ..hooks import uninstall

__all__ = ["initialize", "teardown"]


def initialize(args: argparse.Namespace) -> None:
    """Megatron's parallel state (plus StarTrail's groups when enabled) and seeds."""
    from megatron.core import parallel_state

    forks_die_with_their_parent()  # a checkpoint writer's worker must not outlive its rank
    on_cpu = enable_cpu_support()
    try:
        per_size = None
        if args.hybrid_context_parallel and args.startrail_team_size == "auto":
            from .hybrid import model_team_sizes  # the cost model's pick per sub-group size

            per_size = model_team_sizes(args)
        install_from_args(args, hybrid_team_sizes=per_size)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            **({"hybrid_context_parallel": True} if args.hybrid_context_parallel else {}),
        )
        if on_cpu:
            cpu_manual_seed(args.seed)
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(args.seed)
    except BaseException:
        teardown()
        raise


def teardown() -> None:
    """Undo ``initialize``: parallel state and StarTrail's groups, hooks, CPU patches."""
    from megatron.core import parallel_state

    try:
        parallel_state.destroy_model_parallel()
    finally:
        uninstall()
        disable_cpu_support()
