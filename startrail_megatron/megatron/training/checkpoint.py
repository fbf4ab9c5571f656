"""Checkpoints: Megatron's distributed checkpoint of the model, plus the optimizer state.

The same format whatever the CP implementation or size (a StarTrail run's
checkpoint loads into a CP = 1 run), so a resumed run continues exactly.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil

import torch
import torch.distributed as dist

from ...checkpoint_files import (
    check_pickle_globals,
    commit,
    fsync,
    load_rng_states,
    naming_save_failures,
    read_manifest,
    read_tracker,
    refuse_lost_tracker,
    save_rng_states,
    verify_manifest,
    write_manifest,
)
from .. import rng

__all__ = [
    "add_checkpoint_args",
    "load_checkpoint",
    "model_shape",
    "save_checkpoint",
    "verify_checkpoint",
]


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """The entry point's checkpoint flags (Megatron-LM's names)."""
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="start the optimizer fresh after --load (without it, a checkpoint with no "
        "optimizer state for this tensor-parallel size is an error)",
    )
    g.add_argument(
        "--no-load-rng",
        action="store_true",
        help="after --load, draw dropout from --seed again instead of the saved generator "
        "states (without it they are restored where the checkpoint was saved on the same "
        "ranks and parallel sizes)",
    )
    g.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="the iteration to load from --load (default: its latest checkpoint)",
    )


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


TRACKER = "latest_checkpointed_iteration.txt"


def _rng_layout() -> dict:
    """The ranks a checkpoint's generator states belong to: a rank's file is restored only
    into the same rank of the same sizes (elsewhere its draws would be another rank's)."""
    from megatron.core import parallel_state as ps

    return {
        "world": dist.get_world_size(),
        "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
        "context_parallel": ps.get_context_parallel_world_size(),
    }


SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "normalization",
    "softmax_type",
)  # fmt: skip
"""The model's settings a checkpoint must share with the run that loads it (the
``TransformerConfig`` fields that change a parameter's shape or the parameters present)."""

_ADDED_LATER = ("softmax_type", "position_embedding_type")
"""``model_shape`` keys older manifests lack: compared only where the manifest has them."""


def model_shape(model) -> dict:
    """What ``SHAPE_FIELDS`` (and the padded vocabulary, tied embeddings) are in ``model``."""
    gpt = model.module
    shape = {f: getattr(gpt.config, f, None) for f in SHAPE_FIELDS}
    shape["vocab_size"] = getattr(gpt, "vocab_size", None)
    shape["position_embedding_type"] = getattr(gpt, "position_embedding_type", None)
    shape["share_embeddings_and_output_weights"] = getattr(
        gpt, "share_embeddings_and_output_weights", None
    )
    return shape


def save_checkpoint(
    path: str, model, iteration: int, optimizer=None, global_batch_size: int | None = None
) -> None:
    """Megatron distributed checkpoint of the model (the same format for any CP impl/size),
    plus the optimizer state of each TP rank (identical over CP and DP ranks: no
    distributed optimizer), so a resumed run continues exactly.

    Atomic (``checkpoint_files``' Note [atomic checkpoints]): written into
    ``iter_N.partial``, hashed into its manifest (with the model's shape), renamed to
    ``iter_N``, the tracker last. A save killed at any point leaves the last complete
    checkpoint the tracker's; one that fails (a full disk) is a ``RuntimeError`` naming the
    rank and the folder. ``global_batch_size`` goes into the manifest: a resume at another
    would continue the data and the learning-rate schedule at another sample."""
    from megatron.core import dist_checkpointing, parallel_state

    final = os.path.join(path, f"iter_{iteration:07d}")
    ckpt = final + ".partial"
    with naming_save_failures("--save", ckpt, os.path.join(path, TRACKER)):
        if dist.get_rank() == 0:
            if os.path.exists(ckpt):
                shutil.rmtree(ckpt)  # an earlier save of this iteration that did not finish
            os.makedirs(ckpt)
        dist.barrier()
        _in_process_write_results_queue()
        dist_checkpointing.save(model.module.sharded_state_dict(), ckpt)  # its writer syncs
        save_rng_states(ckpt, rng.capture())  # synced with the rest by the manifest
        if (
            optimizer is not None
            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        ):
            opt_file = _optimizer_file(ckpt)
            torch.save(optimizer.state_dict(), opt_file)
            fsync(opt_file)
        dist.barrier()
        extra = {"model": model_shape(model), "rng": _rng_layout()}
        if global_batch_size is not None:
            extra["global_batch_size"] = global_batch_size
        write_manifest(ckpt, extra)
        if dist.get_rank() == 0:
            commit(ckpt, final, os.path.join(path, TRACKER), str(iteration))
    dist.barrier()


def verify_checkpoint(
    ckpt: str, skip_optimizer: bool = False, model=None, global_batch_size: int | None = None
) -> dict:
    """Check every file the manifest lists against its SHA-256 (each rank a share), on
    every rank: a ``ValueError`` naming the files that differ or are missing, the same on
    every rank, before anything is loaded. ``skip_optimizer``: the optimizer state files are
    not read (``--no-load-optim``). With ``model``, first (before any collective) a
    ``ValueError`` naming each setting of ``model_shape`` the checkpoint's model differs in;
    with ``global_batch_size``, one where the checkpoint was trained at another (the data
    would resume at another sample, skipping or repeating some, and so would the schedule).
    Returns the manifest."""
    content = read_manifest(ckpt, "--load")
    saved_gbs = content.get("global_batch_size")
    if global_batch_size is not None and saved_gbs not in (None, global_batch_size):
        raise ValueError(
            f"--load: {ckpt} was trained with --global-batch-size {saved_gbs} (this run: "
            f"{global_batch_size}); resumed at another, the data would continue at another "
            f"sample (skipping or repeating some) and so would the learning-rate schedule: "
            f"give --global-batch-size {saved_gbs}"
        )
    if model is not None:
        mine, saved = model_shape(model), content.get("model", {})
        differ = [
            f"{k}={saved.get(k)!r} (this run: {v!r})"
            for k, v in mine.items()
            if saved.get(k) != v and (k in saved or k not in _ADDED_LATER)
        ]
        if differ:
            raise ValueError(
                f"--load: {ckpt} holds another model: it was saved with {', '.join(differ)}; "
                "give the saved model's flags"
            )
    verify_manifest(ckpt, content, skip=lambda n: skip_optimizer and n.startswith("optimizer_"))
    return content


def _dcp_metadata_global(module: str, name: str) -> bool:
    """The globals torch.distributed.checkpoint's ``.metadata`` pickle holds: its own
    classes (and megatron-core's plan and metadata classes), ``torch.Size``, dtypes and
    layouts."""
    import importlib

    if module.startswith(("torch.distributed.checkpoint.", "megatron.core.dist_checkpointing.")):
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type)  # its dataclasses and enums, no function
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    }


def _check_unpickled_files(ckpt: str) -> None:
    """What megatron-core and torch unpickle of a checkpoint without our manifest's help
    against a crafted file: torch.distributed.checkpoint reads ``.metadata`` with plain
    ``pickle.load`` (checked for foreign globals), megatron-core ``common.pt`` with
    ``torch.load``'s default (weights-only from torch 2.6 on; checked here for older
    torch). ``ValueError`` naming the file."""
    meta = os.path.join(ckpt, ".metadata")
    if os.path.exists(meta):
        check_pickle_globals(meta, _dcp_metadata_global, "--load")
    common = os.path.join(ckpt, "common.pt")
    if os.path.exists(common):
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - named below
            raise ValueError(
                f"--load: {common} holds more than tensors and plain data; it is not loaded "
                f"(a weights-only load runs no code): {str(e).splitlines()[-1][:200]}"
            ) from None


def load_checkpoint(
    path: str,
    model,
    optimizer=None,
    iteration: int | None = None,
    load_rng: bool = True,
    global_batch_size: int | None = None,
) -> int:
    """Load the checkpoint of ``iteration`` (default: the latest); the optimizer state too
    (saved with the same tensor-parallel size: any CP implementation, CP or DP size; a
    missing one is an error, pass ``optimizer=None`` to start it fresh), read with
    ``weights_only=True`` (tensors and plain containers only: no code runs); with
    ``load_rng``, each rank's generator states where the checkpoint was saved on the same
    ranks and sizes (``_rng_layout``; elsewhere rank 0 says they start from the seed);
    ``global_batch_size``: this run's, refused where the checkpoint's differs
    (``verify_checkpoint``). Returns its iteration; 0 when ``path`` holds no checkpoint yet and no ``iteration`` is
    asked for (Megatron-LM's ``--save DIR --load DIR`` on a first run)."""
    from megatron.core import dist_checkpointing

    from_tracker = iteration is None
    tracker = os.path.join(path, TRACKER)
    if iteration is None:
        if not os.path.exists(tracker):
            refuse_lost_tracker(path, tracker, f"--load {path}", "pass --ckpt-step N")
            if dist.get_rank() == 0:
                print(
                    f"note: --load {path} holds no checkpoint yet; starting from scratch",
                    flush=True,
                )
            return 0
        text = read_tracker(
            tracker, f"--load {path}", str.isdigit, "an iteration number (pass --ckpt-step N)"
        )
        iteration = int(text)
    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    if not os.path.isdir(ckpt):
        where = f"the tracker {tracker} names" if from_tracker else "--ckpt-step asks for"
        raise FileNotFoundError(
            f"--load {path}: {where} iteration {iteration}, which has no checkpoint ({ckpt})"
        )
    opt_file = _optimizer_file(ckpt)
    if optimizer is not None and not os.path.exists(opt_file):  # before any collective
        raise FileNotFoundError(
            f"--load {path}: {opt_file} is missing (no optimizer state saved for this "
            "tensor-parallel size); pass --no-load-optim to start the optimizer fresh"
        )
    manifest = verify_checkpoint(ckpt, optimizer is None, model, global_batch_size)
    _check_unpickled_files(ckpt)
    state = dist_checkpointing.load(model.module.sharded_state_dict(), ckpt)
    model.module.load_state_dict(state)
    if optimizer is not None:
        _load_optimizer(optimizer, torch.load(opt_file, weights_only=True), ckpt)
    if load_rng:  # this rank's generator states where saved on this layout
        state = load_rng_states(ckpt, manifest, _rng_layout(), "--load")
        if state is not None:
            rng.restore(state)
    return iteration


_SCHEDULED = ("params", "lr", "initial_lr", "weight_decay")
"""Param-group keys the learning-rate schedule sets at every step (or that are no setting)."""


def _load_optimizer(optimizer, state: dict, ckpt: str) -> None:
    """The optimizer's state from the checkpoint, its settings from the command line:
    ``load_state_dict`` takes the saved param groups' betas, eps, momentum, ..., so a run
    resumed with another ``--adam-beta2`` would use the old one, silently (as megatron-core's
    does); here the command line's stay, and rank 0 names each that changed."""
    mine = [{k: v for k, v in g.items() if k not in _SCHEDULED} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    changed = set()
    for group, want in zip(optimizer.param_groups, mine, strict=True):
        for k, v in want.items():
            if group.get(k) != v:
                changed.add(f"{k} {group.get(k)!r} -> {v!r}")
                group[k] = v
    if changed and dist.get_rank() == 0:
        print(
            f"note: --load {ckpt}: the optimizer's settings are this command line's, not the "
            f"checkpoint's: {', '.join(sorted(changed))}",
            flush=True,
        )
