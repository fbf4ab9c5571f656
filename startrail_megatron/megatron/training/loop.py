"""The training loop: ``train(args)`` on an initialized process group, with its log.

Each iteration logs the loss, tokens/s and, with StarTrail, the bytes it moved
(P2P and team collectives, from the ledger) against ring attention's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from ...accounting import LocalShape, startrail_comm_bytes
from ...layout import StarTrailLayout
from ..registry import get_startrail_state
from .autotune import autotune_team_size
from .checkpoint import load_checkpoint, save_checkpoint
from .data import build_dataset, global_batches
from .initialize import initialize, teardown
from .model import build_model, build_optimizer
from .step import forward_backward, optimizer_step, rank_device

__all__ = ["train"]


def _startrail_bytes(args) -> dict:
    """StarTrail's bytes in the last iteration, summed over the CP group, and ring's (and
    the attention calls that ran attention dropout).

    Measured from the ledger; ring attention's figure is the accounting's for C = 1 at the
    same shapes: each attention call's local length, as recorded by the attention (the
    tests check the accounting against ledgers).
    """
    from megatron.core import parallel_state

    cp_group = parallel_state.get_context_parallel_group()
    state = get_startrail_state(cp_group)
    led, lay = state.ledger, state.groups.layout
    ring_lay, rank = StarTrailLayout(lay.cp_size, 1), state.groups.cp_rank
    ring_p2p = 0
    for s_local, calls in state.calls_by_length.items():  # packed batches vary in length
        shape = LocalShape(
            s_local=s_local,
            batch=args.micro_batch_size if not args.reset_attention_mask else 1,
            heads_q=args.num_attention_heads // args.tensor_model_parallel_size,
            heads_kv=max(args.num_query_groups // args.tensor_model_parallel_size, 1),
            head_dim=args.hidden_size // args.num_attention_heads,
            elem_bytes=2 if args.bf16 else 4,
        )
        ring = startrail_comm_bytes(ring_lay, rank, shape)
        ring_p2p += (ring["fwd_p2p"] + ring["bwd_p2p"]) * calls
    figures = torch.tensor(
        [led.bytes("p2p"), led.bytes("collective"), ring_p2p, state.dropout_calls],
        dtype=torch.float64,
        device=rank_device(),
    )
    led.clear()
    state.calls_by_length.clear()
    state.dropout_calls = 0
    dist.all_reduce(figures, group=cp_group)
    return {
        "p2p": figures[0].item(),
        "collective": figures[1].item(),
        "ring_p2p": figures[2].item(),
        "dropout_calls": int(figures[3].item()),
    }


def train(args: argparse.Namespace) -> list[dict]:
    """Run the training loop on an initialized process group; returns the log."""
    initialize(args)
    rank = dist.get_rank()
    try:
        model = build_model(args)
        optimizer = build_optimizer(args, model)
        if args.context_parallel_impl == "startrail" and args.startrail_team_size == "auto":
            autotune_team_size(args, model)
        start = 0
        if args.load:
            start = load_checkpoint(args.load, model, optimizer, args.ckpt_step)
        dataset = build_dataset(args, (args.train_iters + 1) * args.global_batch_size)
        batches = global_batches(args, dataset)
        for _ in range(start):
            next(batches)
        log = []
        for it in range(start + 1, args.train_iters + 1):
            t0 = time.perf_counter()
            loss = forward_backward(args, model, next(batches))
            optimizer_step(model, optimizer, args.clip_grad)
            dt = time.perf_counter() - t0
            entry = {
                "iteration": it,
                "loss": loss,
                "seconds": dt,
                "tokens_per_s": args.global_batch_size * args.seq_length / dt,
            }
            if args.context_parallel_impl == "startrail":
                entry["startrail"] = _startrail_bytes(args)
            log.append(entry)
            if rank == 0 and (it % args.log_interval == 0 or it == args.train_iters):
                _print_iteration(args, entry)
            if args.save and args.save_interval and it % args.save_interval == 0:
                save_checkpoint(args.save, model, it, optimizer)
        if args.save and (not args.save_interval or args.train_iters % args.save_interval):
            save_checkpoint(args.save, model, args.train_iters, optimizer)
        if rank == 0 and args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(log, f, indent=1)
        return log
    finally:
        teardown()


def _print_iteration(args, e: dict) -> None:
    width = len(str(args.train_iters))
    line = (
        f" iteration {e['iteration']:>{width}}/{args.train_iters} | lm loss {e['loss']:.6f} | "
        f"{e['seconds'] * 1000:7.1f} ms | {e['tokens_per_s']:8.0f} tokens/s"
    )
    st = e.get("startrail")
    if st:
        saved = 1 - st["p2p"] / st["ring_p2p"] if st["ring_p2p"] else 0.0
        line += (
            f" | StarTrail P2P {st['p2p'] / 1e6:.2f} MB vs ring {st['ring_p2p'] / 1e6:.2f} MB "
            f"({saved:.0%} less), collectives {st['collective'] / 1e6:.2f} MB (CP group)"
        )
    print(line, flush=True)
