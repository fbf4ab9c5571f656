"""A plain DeepSpeed training script (no StarTrail code): a tiny Llama on random tokens.

    torchrun --nproc-per-node 4 -m startrail_megatron.deepspeed.launch \
        scripts/train_tiny_llama.py --deepspeed_config configs/startrail_deepspeed.json

Each data-parallel replica takes its rows of one global batch; the ranks that
share a replica (DeepSpeed's sequence-parallel ranks, if any) get the same rows.
Without the launcher (``torchrun ... scripts/train_tiny_llama.py ...``) it is
ordinary data-parallel DeepSpeed.

``--save DIR`` (every ``--save-interval`` steps) and ``--load DIR`` (resume from its latest
checkpoint) use ``startrail_megatron.deepspeed``'s ``save_checkpoint`` /
``load_checkpoint`` (atomic, checksummed, weights-only loads) in place of the engine's own:
the one StarTrail import of the script, and only with those flags.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument(
        "--documents",
        type=int,
        default=1,
        help="documents per row, packed: cut at random points, position_ids restarting at 0 "
        "for each (transformers' DataCollatorWithFlattening layout; one row per micro-batch)",
    )
    ap.add_argument(
        "--attention-dropout", type=float, default=0.0, help="the model's attention dropout"
    )
    ap.add_argument("--out", default=None, help="write this rank's losses as JSON here")
    ap.add_argument("--save", default=None, help="save a checkpoint here")
    ap.add_argument("--save-interval", type=int, default=1, help="steps between saves")
    ap.add_argument("--load", default=None, help="resume from this folder's latest checkpoint")
    ap.add_argument(
        "--no-load-rng",
        action="store_true",
        help="with --load, keep the seeded generators instead of the saved ones",
    )
    ap.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=None,
        help="the collective timeout (DeepSpeed's default: 30 minutes)",
    )
    args = ap.parse_args()

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(64, args.seq),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        attention_dropout=args.attention_dropout,
    )
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    if get_accelerator().device_name() == "cuda" and local_rank >= 0:
        get_accelerator().set_device(local_rank)  # one GPU per rank; CPU ranks skip this
    if args.distributed_timeout_minutes is not None:
        deepspeed.init_distributed(
            dist_backend=get_accelerator().communication_backend_name(),
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=opt)

    world = torch.distributed.get_world_size()
    replicas = engine.train_batch_size() // (
        engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
    )
    replica = torch.distributed.get_rank() // (world // replicas)
    micro = engine.train_micro_batch_size_per_gpu()
    g = torch.Generator().manual_seed(1234)
    losses = []
    start = 0
    if args.load or args.save:
        from startrail_megatron.deepspeed import load_checkpoint, save_checkpoint
    if args.load:
        _, client = load_checkpoint(engine, args.load, load_rng_states=not args.no_load_rng)
        start = client["step"] if client else 0
    for step in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (replicas * micro, args.seq), generator=g)
        if args.documents > 1:  # drawn only then: one document keeps the batches as they were
            cuts = torch.randperm(args.seq - 1, generator=g)[: args.documents - 1] + 1
        if step < start:
            continue  # done before the checkpoint: its batch drawn, not trained again
        mine = ids[replica * micro : (replica + 1) * micro].to(engine.device)
        batch = {"input_ids": mine, "labels": mine}
        if args.documents > 1:  # one packed row: positions restart at every cut
            bounds = [0, *sorted(cuts.tolist()), args.seq]
            pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
            batch["position_ids"] = pos.expand(micro, -1).to(engine.device)
        began = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        took = time.perf_counter() - began
        if torch.distributed.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f} ({took * 1e3:.0f} ms)", flush=True)
        if args.save and (step + 1) % args.save_interval == 0:
            save_checkpoint(
                engine, args.save, tag=f"step{step + 1}", client_state={"step": step + 1}
            )
    handle = getattr(engine, "startrail_handle", None)  # set when StarTrail is on
    if handle is not None and torch.distributed.get_rank() == 0:
        led, lengths = handle.ledger, sorted(handle.local_lengths)
        print(
            f"StarTrail on rank 0: {led.bytes('p2p')} P2P bytes, {led.bytes('collective')} "
            f"collective bytes; local sequence lengths {lengths}"
        )
    if args.out:
        out = {"losses": losses, "first_step": start, "startrail": handle is not None}
        if handle is not None:
            mpu = engine.startrail_mpu
            out["proof"] = {
                "ledger": handle.ledger.summary(),
                "local_lengths": sorted(handle.local_lengths),
                "attn": model.config._attn_implementation,
                "layout": [
                    mpu.startrail.cp_size,
                    mpu.startrail.team_size,
                    mpu.startrail.layout.placement,
                ],
                "cp_rank": mpu.startrail.cp_rank,
                "elem_bytes": next(model.parameters()).element_size(),
                "attention_calls": args.steps * cfg.num_hidden_layers,
            }
        with open(f"{args.out}.{torch.distributed.get_rank()}", "w") as f:
            json.dump(out, f)
    # every rank got here: a rank stalled after the last step ends the job at the collective
    # timeout instead of leaving the launcher waiting for it forever
    torch.distributed.barrier()
    del engine


if __name__ == "__main__":
    main()
