"""DeepSpeed checkpoints that are complete or absent, verified and loaded without code.

    from startrail_megatron.deepspeed import load_checkpoint, save_checkpoint
    save_checkpoint(engine, "ckpt")             # in place of engine.save_checkpoint("ckpt")
    path, client_state = load_checkpoint(engine, "ckpt")

DeepSpeed's own ``engine.save_checkpoint`` writes the tag's folder in place and rank 0
writes ``latest`` in place right after its own files, before the other ranks' ZeRO
files are written: a crash mid-save can leave ``latest`` naming a checkpoint with files
missing, or empty. Its loads run ``torch.load(..., weights_only=False)``: a crafted file
in a load folder runs code. These two wrap the engine's calls (any ZeRO stage, with or
without StarTrail; DeepSpeed's format unchanged, so its own tools still read the folder):

- ``save_checkpoint`` writes the tag into ``TAG.partial`` (``save_latest=False``), then
  ``checkpoint_files``' Note [atomic checkpoints]: every file synced and hashed into the
  manifest, the folder renamed to ``TAG``, ``latest`` written last through a rename. A
  failed write (a full disk) is a ``RuntimeError`` naming the rank and the folder.
- ``load_checkpoint`` checks every file against the manifest on every rank first (a
  flipped byte, a truncated or missing file, the optimizer's included: a ``ValueError``
  naming them), then lets the engine load with ``weights_only=True`` (DeepSpeed's own data
  classes allowed: ``SAFE_GLOBALS``). A folder without a manifest (not saved by
  ``save_checkpoint``) is refused by name; ``verify=False`` loads it unchecked, still
  without running code.
- Each rank's torch generators go with the checkpoint (``rng/rankNNNNN.pt``; DeepSpeed's
  engine keeps none) and come back at a load on as many ranks (``load_rng_states=False``:
  not): a resumed run with dropout draws the masks the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import shutil
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint_files import (
    MANIFEST,
    commit,
    generator_states,
    load_rng_states,
    naming_save_failures,
    read_manifest,
    read_tracker,
    refuse_lost_tracker,
    restore_generators,
    save_rng_states,
    verify_manifest,
    write_manifest,
)

__all__ = ["SAFE_GLOBALS", "TRACKER", "load_checkpoint", "save_checkpoint"]

TRACKER = "latest"
"""DeepSpeed's own tracker file: ``engine.load_checkpoint(dir)`` finds our saves too."""

SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The classes of DeepSpeed's checkpoints (ZeRO 0 - 3, fp32 and bf16 on 0.19.8) a
weights-only load is allowed to rebuild: plain data holders, whose rebuilding runs no
code of the file's choosing."""


def _safe_globals() -> list:
    found = []
    for dotted in SAFE_GLOBALS:
        mod, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass  # another DeepSpeed release: the class is not there to allow
    return found


@contextlib.contextmanager
def _weights_only_loads(engine: Any) -> Iterator[None]:
    """The engine's checkpoint engine loads with ``weights_only=True`` for the call; a file
    that needs anything else is a ``ValueError`` naming it and what it asked for."""
    ce = engine.checkpoint_engine
    allowed = _safe_globals()

    def load(path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            why = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
            raise ValueError(
                f"load_checkpoint: {path} holds more than tensors and DeepSpeed's data "
                f"classes ({why}); it is not loaded (a weights-only load runs no code)"
            ) from None

    ce.load = load  # an instance attribute over the class's method, for this call only
    try:
        yield
    finally:
        del ce.load


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag.endswith(".partial") or tag in (".", ".."):
        raise ValueError(
            f"save_checkpoint: tag {tag!r} must be a non-empty folder name without '/' "
            "that does not end in '.partial' (the name of a save under way)"
        )


def save_checkpoint(
    engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None
) -> str:
    """Save ``engine`` as DeepSpeed does, atomically (the module's docstring); every rank
    calls it. Returns the checkpoint's folder. ``tag`` defaults to DeepSpeed's
    ``global_step{N}``."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _check_tag(tag)
    tracker = os.path.join(save_dir, TRACKER)
    final = os.path.join(save_dir, tag)
    partial = final + ".partial"
    with naming_save_failures("save_checkpoint", partial, tracker):
        if dist.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.exists(partial):
                shutil.rmtree(partial)  # an earlier save of this tag that did not finish
        dist.barrier()
        engine.save_checkpoint(
            save_dir, tag=tag + ".partial", client_state=client_state or {}, save_latest=False
        )
        save_rng_states(partial, _generator_states())
        dist.barrier()  # every rank's files written (the manifest's pass syncs them)
        write_manifest(partial, {"tag": tag, "rng": _rng_ranks(engine)})
        if dist.get_rank() == 0:
            commit(partial, final, tracker, tag)
    dist.barrier()
    return final


def _rng_ranks(engine) -> dict:
    """The ranks a save's generator states belong to (a rank's file is restored only into
    a run on as many ranks, in sequence groups of the same size)."""
    mpu = getattr(engine, "startrail_mpu", None)
    p = mpu.get_sequence_parallel_world_size() if mpu is not None else 1
    return {"world": dist.get_world_size(), "sequence_parallel": p}


def _generator_states() -> dict:
    """This rank's torch generators, and megatron-core's RNG tracker where a Megatron GPT
    draws from it (``megatron.rng``)."""
    from ..megatron import rng

    return rng.capture() if rng.tracker_in_use() else generator_states()


def load_checkpoint(
    engine: Any,
    load_dir: str,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    verify: bool = True,
    load_rng_states: bool = True,
    **kwargs: Any,
) -> tuple[str | None, dict | None]:
    """Load what ``save_checkpoint`` saved (the module's docstring); every rank calls it.
    ``tag`` defaults to the tracker's; ``load_optimizer_states=False`` starts the optimizer
    fresh (its files are then not read); ``load_rng_states=False`` leaves the generators as
    they are; other keywords go to ``engine.load_checkpoint``.
    Returns its ``(path, client_state)``; ``(None, None)`` when ``load_dir`` holds no
    tracker yet and no ``tag`` is asked for (a first run), as DeepSpeed."""
    from_tracker = tag is None
    tracker = os.path.join(load_dir, TRACKER)
    if tag is None:
        if not os.path.exists(tracker):
            refuse_lost_tracker(load_dir, tracker, "load_checkpoint", "pass tag=")
            if dist.get_rank() == 0:
                print(f"note: load_checkpoint: {load_dir} holds no checkpoint yet", flush=True)
            return None, None
        tag = read_tracker(
            tracker,
            "load_checkpoint",
            lambda t: bool(t) and "/" not in t and not t.endswith(".partial"),
            "a checkpoint's tag",
        )
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        where = f"the tracker {tracker} names" if from_tracker else "asked for"
        raise FileNotFoundError(
            f"load_checkpoint: {where} {tag!r}, which is no checkpoint folder in {load_dir}"
        )
    manifest = {}
    if verify:
        manifest = read_manifest(folder, "load_checkpoint")
        skip_optim = not load_optimizer_states
        verify_manifest(
            folder,
            manifest,
            skip=lambda n: skip_optim and "optim_states" in n,
            setting="load_checkpoint",
        )
    with _weights_only_loads(engine):
        out = engine.load_checkpoint(
            load_dir, tag, load_optimizer_states=load_optimizer_states, **kwargs
        )
    if load_rng_states:
        _load_rng(engine, folder, manifest)
    return out


def _load_rng(engine, folder: str, manifest: dict) -> None:
    """This rank's generator states from ``folder``, where saved on as many ranks (the
    manifest says; read here where ``verify=False`` did not)."""
    if not manifest and os.path.exists(os.path.join(folder, MANIFEST)):
        manifest = read_manifest(folder, "load_checkpoint")
    state = load_rng_states(folder, manifest, _rng_ranks(engine), "load_checkpoint")
    if state is not None:
        from ..megatron import rng

        if "tracker" in state and rng.tracker_in_use():
            rng.restore(state)
        else:
            restore_generators(state)
