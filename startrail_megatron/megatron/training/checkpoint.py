"""Checkpoints: Megatron's distributed checkpoint of the model, plus the optimizer state.

The same format whatever the CP implementation or size (a StarTrail run's
checkpoint loads into a CP = 1 run), so a resumed run continues exactly.
"""

from __future__ import annotations

import os
import queue

import torch
import torch.distributed as dist

__all__ = ["load_checkpoint", "save_checkpoint"]


def _in_process_write_results_queue() -> None:
    """Give megatron-core's checkpoint writer a results queue with no process behind it.

    Its writer (``dist_checkpointing.strategies.filesystem_async``, 0.16 - 0.19) makes the
    queue on a rank's first save through a ``multiprocessing`` Manager: a server process
    that outlives the save. Started by spawn, it is a new interpreter that imports the entry
    point again (~5 s of CPU per rank); started by fork, it inherits the rank's sockets and
    its pipe to the launcher, so a rank that dies after its first save is seen by no one
    (the job hangs until the collective timeout) and the Manager outlives the job. Our saves
    are synchronous: the rank itself puts the write results into the queue and takes them
    out (the writer's own worker processes are joined within the save), so a thread queue
    does it, with no helper process at all."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", False) is None:
        fa._results_queue = queue.Queue()


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
    _in_process_write_results_queue()
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
    (saved with the same tensor-parallel size: any CP implementation, CP or DP size; a
    missing one is an error, pass ``optimizer=None`` to start it fresh), read with
    ``weights_only=True`` (tensors and plain containers only: no code runs). Returns its
    iteration; 0 when ``path`` holds no checkpoint yet and no ``iteration`` is asked for
    (Megatron-LM's ``--save DIR --load DIR`` on a first run)."""
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
            text = f.read().strip()
        if not text.isdigit():
            raise ValueError(
                f"--load {path}: the tracker {tracker} holds {text[:40]!r}, not an iteration "
                "number (a save interrupted while writing it?); pass --ckpt-step N"
            )
        iteration = int(text)
    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(f"--load {path}: no checkpoint of iteration {iteration} ({ckpt})")
    opt_file = _optimizer_file(ckpt)
    if optimizer is not None and not os.path.exists(opt_file):  # before any collective
        raise FileNotFoundError(
            f"--load {path}: {opt_file} is missing (no optimizer state saved for this "
            "tensor-parallel size); pass --no-load-optim to start the optimizer fresh"
        )
    state = dist_checkpointing.load(model.module.sharded_state_dict(), ckpt)
    model.module.load_state_dict(state)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(opt_file, weights_only=True))
    return iteration
