"""Demo: StarTrail attention on CPU ranks, checked against a float64 reference.

    python -m startrail_megatron.demo --nproc 4 --team-size 2

Spawns ``--nproc`` gloo ranks (or uses an existing torchrun launch), runs the
attention forward and backward with StarTrail (team size C) and with ring
attention (C = 1) on the same inputs, and prints the error of each against a
single-process float64 reference and the bytes each rank sent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from .attention import startrail_attention
from .comm import CommLedger
from .groups import StarTrailGroups
from .schedule.layout import StarTrailLayout
from .spawn import spawn_local_ranks
from .testing import make_inputs, reference_attention, rel_err
from .zigzag import zigzag_shard, zigzag_unshard

LIMIT = 1e-5
"""Relative error against float64 above which the demo fails (fp32 inputs)."""


def _run(rank: int, world: int, args) -> None:
    torch.set_num_threads(1)
    n = args.seq_len
    q, k, v, dout = make_inputs(
        0, n, args.batch, args.heads, args.kv_heads, args.head_dim, dtype=torch.float32
    )
    ref = reference_attention(q, k, v, dout, True) if rank == 0 else None
    rows = []
    for c in sorted({1, args.team_size}):
        groups = StarTrailGroups.create(c, placement=args.placement)
        ledger = CommLedger()
        local = [zigzag_shard(t, rank, world).requires_grad_() for t in (q, k, v)]
        out = startrail_attention(*local, groups, causal=True, ledger=ledger)
        out.backward(zigzag_shard(dout, rank, world))
        mine = [out.detach(), *(t.grad for t in local)]
        gathered = [[torch.empty_like(x) for _ in range(world)] for x in mine]
        for g, x in zip(gathered, mine):
            dist.all_gather(g, x.contiguous())
        sent = torch.tensor(
            [ledger.bytes("p2p", "fwd"), ledger.bytes("p2p", "bwd"), ledger.bytes("collective")],
            dtype=torch.float64,
        )
        dist.all_reduce(sent)
        if rank == 0:
            errs = [rel_err(zigzag_unshard(g), r) for g, r in zip(gathered, ref)]
            rows.append((c, errs, sent.tolist()))
    if rank == 0:
        print(
            f"StarTrail demo: P={world} ranks (gloo, CPU), seq {n}, batch {args.batch}, "
            f"{args.heads} q heads / {args.kv_heads} kv heads, head_dim {args.head_dim}, causal"
        )
        print(
            f"{'':14s}{'max rel err vs fp64 (out, dq, dk, dv)':44s}"
            f"{'P2P fwd':>12s}{'P2P bwd':>12s}{'collective':>12s}  (bytes, all ranks)"
        )
        for c, errs, (f, b, col) in rows:
            name = "ring (C=1)" if c == 1 else f"StarTrail C={c}"
            print(
                f"{name:14s}{'  '.join(f'{e:.1e}' for e in errs):44s}{f:12.0f}{b:12.0f}{col:12.0f}"
            )
        if len(rows) == 2:
            (_, _, base), (_, _, st) = rows
            print(
                f"StarTrail C={args.team_size} P2P bytes vs ring: forward {st[0] / base[0]:.3f}x, "
                f"backward {st[1] / base[1]:.3f}x"
            )
        worst = max(e for _, errs, _ in rows for e in errs)
        print(
            f"{'PASS' if worst < LIMIT else 'FAIL'}: worst relative error {worst:.1e} "
            f"(limit {LIMIT:.0e})"
        )
        with open(args.json, "w") as f:
            keys = ("p2p_fwd", "p2p_bwd", "collective")
            json.dump(
                [
                    {"team_size": c, "errors": dict(zip(("out", "dq", "dk", "dv"), errs)),
                     **dict(zip(keys, sent))}
                    for c, errs, sent in rows
                ],
                f,
            )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--nproc", type=int, default=4, help="CPU ranks to spawn (ignored under torchrun)"
    )
    p.add_argument("--team-size", type=int, default=2, help="StarTrail team size C (C*C | nproc)")
    p.add_argument("--placement", choices=["team", "ring"], default="team")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the figures (errors, bytes) here")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:
        StarTrailLayout(world, args.team_size, args.placement)
    except ValueError as e:
        p.error(f"--team-size/--nproc: {e}")
    if args.seq_len % (2 * world):
        p.error(f"--seq-len {args.seq_len} must be divisible by 2*nproc = {2 * world}")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.json
        args.json = out or os.path.join(tmp, "demo.json")
        if "RANK" in os.environ:  # launched by torchrun
            dist.init_process_group("gloo")
            try:
                _run(dist.get_rank(), world, args)
            finally:
                dist.destroy_process_group()
            if dist.get_rank() != 0:
                return
        else:
            spawn_local_ranks(_run, world, args, timeout=timedelta(seconds=120))
        with open(args.json) as f:
            rows = json.load(f)
    if max(e for row in rows for e in row["errors"].values()) >= LIMIT:
        sys.exit(1)


if __name__ == "__main__":
    main()
