"""The DiT trainer's DeepSpeed path: ``dit.loop.run_training`` on a model prepared by
``initialize`` (the config's ``"startrail"`` section gives P, C and the placement; the
loss scale is ``engine.startrail_handle.grad_scale``).

This adapter sits above ``dit/`` (it imports the DiT loop; ``dit/`` never imports
``deepspeed/``); ``python -m startrail_megatron.dit.train --deepspeed-config ds.json``
calls ``run_training`` here.
"""

from __future__ import annotations

import json

from ..dit.data import ReplicaBatches
from ..dit.loop import TrainArgs, TrainResult, TrainSetup, build_optimizer
from ..dit.loop import run_training as run_dit_training
from ..dit.model import DiT
from .entry import initialize

__all__ = ["deepspeed_setup", "run_training"]


def deepspeed_setup(model: DiT, args: TrainArgs) -> TrainSetup:
    """The ``TrainSetup`` of ``args.deepspeed_config``: ``initialize`` with ``args``'
    optimizer; ``--kernel`` is ours, the rest of StarTrail's settings the section's.
    ``ValueError`` where ``--cp-size`` differs from ``startrail.sequence_parallel_size``."""
    with open(args.deepspeed_config) as f:
        cfg = json.load(f)
    _refuse_ignored(cfg, args)
    opt = build_optimizer(model, args)
    engine, _, _, _ = initialize(model=model, optimizer=opt, config=cfg)
    handle = engine.startrail_handle
    handle.sdpa.kernel = args.kernel  # the section gives P, C and placement; --kernel is ours
    mpu = engine.startrail_mpu
    lay = mpu.startrail.layout
    for flag, value, default, key, have in (
        ("--team-size", args.team_size, 1, "team_size", lay.team_size),
        ("--placement", args.placement, "team", "placement", lay.placement),
    ):  # the section gives them: a different one on the command line would be ignored
        if value not in (default, have):
            raise ValueError(
                f"{flag} {value} differs from the DeepSpeed config's startrail.{key} "
                f"{have!r}: give one of them"
            )
    if args.cp_size not in (None, mpu.startrail.cp_size):
        raise ValueError(
            f"--cp-size {args.cp_size} differs from the DeepSpeed config's "
            f"startrail.sequence_parallel_size {mpu.startrail.cp_size}: give one of them"
        )
    return TrainSetup(
        engine, handle, mpu.data_parallel_rank, mpu.data_parallel_size,
        grad_scale=handle.grad_scale, engine=engine,
    )  # fmt: skip


def _refuse_ignored(cfg: dict, args: TrainArgs) -> None:
    """The config's settings the DiT trainer would not honour, each named: it builds its
    own optimizer (``--optimizer``, ``--lr``), draws ``--micro-batch-size`` samples a step
    and casts the model and its inputs to ``--dtype``."""
    if "optimizer" in cfg:
        raise ValueError(
            "the DeepSpeed config's optimizer section: the DiT trainer builds its optimizer "
            "from --optimizer and --lr; remove the section"
        )
    mbs = cfg.get("train_micro_batch_size_per_gpu")
    if mbs is not None and mbs != args.micro_batch_size:
        raise ValueError(
            f"train_micro_batch_size_per_gpu={mbs} in the DeepSpeed config differs from "
            f"--micro-batch-size {args.micro_batch_size} (the samples the trainer draws per "
            "step): give the same in both"
        )
    for key in ("bf16", "fp16"):
        if (cfg.get(key) or {}).get("enabled", False):
            raise ValueError(
                f"the DeepSpeed config's {key} section: the DiT trainer runs the model and its "
                "inputs in --dtype (fp32 with DeepSpeed; DeepSpeed would cast the weights "
                "alone); remove it"
            )


def run_training(args: TrainArgs, batches: ReplicaBatches | None = None, log=print) -> TrainResult:
    """``dit.loop.run_training`` under DeepSpeed (``args.deepspeed_config``, required)."""
    if args.deepspeed_config is None:
        raise ValueError(
            "deepspeed.dit.run_training needs deepspeed_config (--deepspeed-config); without "
            "it call startrail_megatron.dit.loop.run_training"
        )
    return run_dit_training(args, batches=batches, log=log, prepare=deepspeed_setup)
