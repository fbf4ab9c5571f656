"""Train a small DiT (or MMDiT) with StarTrail: ``python -m startrail_megatron.dit.train``.

Denoising diffusion (DDPM, epsilon prediction, linear betas, 1000 steps) on synthetic
class-conditional images, so it runs anywhere with no download. World = D data-parallel
replicas x P StarTrail ranks (global rank = d * P + cp_rank, as ``deepspeed.StarTrailMPU``).
Every rank of a replica draws the same batch, timesteps, noise and label drop from the
replica's generator (checked each step: ``check_replicated``); replicas draw different ones.
Each rank's loss is its part of the replica's mean squared error over real tokens;
gradients are summed over the world and divided by D (plain PyTorch), or reduced by
DeepSpeed (``--deepspeed-config`` with a ``"startrail"`` section).

    python -m startrail_megatron.dit.train --nproc 8 --team-size 2 --steps 30
    python -m startrail_megatron.dit.train --nproc 4 --team-size 2 --text-tokens 8 \\
        --image-size 14 --deepspeed-config ds.json

This module is the command line only (the data: ``data.py``; the settings and the loop:
``loop.py``; the DeepSpeed path: ``deepspeed/dit.py``). It is an entry point above both
``dit/`` and ``deepspeed/`` (``tests/test_imports.py``): nothing in the package imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cli_options import add_own_rows_first
from ..schedule.layout import PLACEMENTS
from .loop import DTYPES, TrainArgs, run_training
from .model import DiTConfig

__all__ = ["args_from_cli", "main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m startrail_megatron.dit.train",
        description="Train a small DiT / MMDiT with StarTrail (full attention) on CPU or GPU ranks.",
    )
    ap.add_argument("--nproc", type=int, default=None, help="spawn this many gloo CPU ranks")
    ap.add_argument("--cp-size", type=int, default=None, help="P (default: the world size)")
    ap.add_argument("--team-size", type=int, default=1, help="C; C*C must divide P")
    ap.add_argument("--placement", default="team", choices=list(PLACEMENTS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-size", default="16", help="H or H,W (latent pixels)")
    ap.add_argument("--frames", type=int, default=1, help="> 1: video latents")
    ap.add_argument("--patch-size", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=0, help="> 0: MMDiT joint attention")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--kernel", default="auto")
    add_own_rows_first(ap)
    ap.add_argument(
        "--deepspeed-config", default=None, help="a DeepSpeed JSON with a startrail section"
    )
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--json-log", default=None)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    return ap


def args_from_cli(argv=None) -> tuple[TrainArgs, argparse.Namespace]:
    ns = _parser().parse_args(argv)
    hw = [int(x) for x in str(ns.image_size).split(",")]
    if len(hw) not in (1, 2):
        raise ValueError(f"--image-size {ns.image_size!r}: give H or H,W")
    h, w = hw[0], hw[-1]
    model = DiTConfig(
        height=h, width=w, frames=ns.frames, patch_size=ns.patch_size, hidden_size=ns.hidden_size,
        depth=ns.depth, num_heads=ns.num_heads, text_tokens=ns.text_tokens,
    )  # fmt: skip
    args = TrainArgs(
        model=model, steps=ns.steps, micro_batch_size=ns.micro_batch_size, lr=ns.lr,
        weight_decay=ns.weight_decay, optimizer=ns.optimizer, seed=ns.seed, team_size=ns.team_size,
        placement=ns.placement, cp_size=ns.cp_size, dtype=ns.dtype, kernel=ns.kernel,
        own_rows_first=ns.own_rows_first,
        deepspeed_config=ns.deepspeed_config, log_interval=ns.log_interval, json_log=ns.json_log,
    )  # fmt: skip
    return args, ns


def _trainer(args: TrainArgs):
    """``run_training`` of the plain loop, or of the DeepSpeed path for ``--deepspeed-config``
    (imported here: this command sits above ``dit/`` and ``deepspeed/``)."""
    if args.deepspeed_config is None:
        return run_training
    from ..deepspeed.dit import run_training as run_deepspeed_training

    return run_deepspeed_training


def _rank_main(rank: int, world: int, args: TrainArgs) -> None:
    res = _trainer(args)(args)
    if rank == 0:
        h = res.handle
        led = h.sdpa.ledger
        print(
            f"StarTrail ran {h.sdpa.calls} attention calls on rank 0; sent "
            f"{led.bytes('p2p') / 2**20:.2f} MiB P2P, {led.bytes('collective') / 2**20:.2f} MiB "
            f"collective; loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}"
        )


def _spawned_rank_main(rank: int, world: int, args: TrainArgs) -> None:
    """A ``--nproc`` rank: what a launcher would set (DeepSpeed reads it), then train."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    _rank_main(rank, world, args)
    # End the rank here, after every rank is done: a gloo (or DeepSpeed) rank's normal
    # interpreter exit aborts now and then ("terminate called without an active exception",
    # seen with torch 2.13's gloo on CPU), failing a run that succeeded.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> None:
    args, ns = args_from_cli(argv)
    if ns.nproc is not None:
        from ..spawn import spawn_local_ranks

        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # CPU ranks, also for DeepSpeed
        spawn_local_ranks(
            _spawned_rank_main, ns.nproc, args, timeout=timedelta(seconds=ns.timeout_s)
        )
        return
    if not dist.is_initialized():  # torchrun / deepspeed launcher
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=ns.timeout_s))
    try:
        _rank_main(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
