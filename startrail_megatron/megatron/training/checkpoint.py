"""Checkpoints: Megatron's distributed checkpoint of the model, plus the optimizer state.

The same format whatever the CP implementation or size (a StarTrail run's
checkpoint loads into a CP = 1 run), so a resumed run continues exactly.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import torch
import torch.distributed as dist

__all__ = ["load_checkpoint", "save_checkpoint"]


def _forked_write_results_queue() -> None:
    """On CPU ranks, make megatron-core's checkpoint-writer results queue by fork.

    Its writer (``dist_checkpointing.strategies.filesystem_async``, 0.16 - 0.19) makes the
    queue on a rank's first save through a ``multiprocessing`` Manager started by *spawn*:
    a new interpreter that imports the entry point again (megatron-core and all: ~5 s of
    CPU per rank, the most of a small model's first save on CPU ranks). A rank's fork of
    it runs only the Manager's server loop, no torch op and no device; where there is a
    device, or the module keeps no such queue, megatron-core's own way stands."""
    if torch.cuda.is_available():
        return
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", False) is None:
        fa._results_queue = mp.get_context("fork").Manager().Queue()


def _optimizer_file(ckpt: str) -> str:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    return os.path.join(
        ckpt, f"optimizer_tp{parallel_state.get_tensor_model_parallel_rank()}_of{tp}.pt"
    )


def save_checkpoint(path: str, model, iteration: int, optimizer=None) -> None:
    """Megatron distributed checkpoint of the model (the same format for any CP impl/size),
    plus the optimizer state of each TP rank (identical over CP and DP ranks: no
    distributed optimizer), so a resumed run continues exactly."""
    from megatron.core import dist_checkpointing, parallel_state

    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    _forked_write_results_queue()
    dist_checkpointing.save(model.module.sharded_state_dict(), ckpt)
    if (
        optimizer is not None
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    ):
        torch.save(optimizer.state_dict(), _optimizer_file(ckpt))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def load_checkpoint(path: str, model, optimizer=None, iteration: int | None = None) -> int:
    """Load the checkpoint of ``iteration`` (default: the latest); the optimizer state too
    when it was saved with the same tensor-parallel size (any CP implementation, CP or DP
    size). Returns its iteration; 0 when ``path`` holds no checkpoint yet and no
    ``iteration`` is asked for (Megatron-LM's ``--save DIR --load DIR`` on a first run)."""
    from megatron.core import dist_checkpointing

    if iteration is None:
        tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
        if not os.path.exists(tracker):
            if dist.get_rank() == 0:
                print(
                    f"note: --load {path} holds no checkpoint yet; starting from scratch",
                    flush=True,
                )
            return 0
        with open(tracker) as f:
            iteration = int(f.read().strip())
    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(f"--load {path}: no checkpoint of iteration {iteration} ({ckpt})")
    state = dist_checkpointing.load(model.module.sharded_state_dict(), ckpt)
    model.module.load_state_dict(state)
    if optimizer is not None:
        opt_file = _optimizer_file(ckpt)
        if os.path.exists(opt_file):
            optimizer.load_state_dict(torch.load(opt_file, weights_only=False))
        elif dist.get_rank() == 0:
            print(
                f"note: {ckpt} has no optimizer state for this tensor-parallel size; "
                "the optimizer starts fresh",
                flush=True,
            )
    return iteration
