"""Side-by-side benchmark: StarTrail (every C, both placements), ring, all-gather-KV, Ulysses.

    startrail-bench --nproc 4 --seq-len 4096          # or scripts/bench_attention.py

One run, the same inputs, shapes and ranks for every strategy. For each it
times forward + backward (``--warmup`` untimed, then ``--repeats`` timed rounds;
a repeat's time is the slowest rank's; the rounds interleave all strategies and
the microbenchmarks, so load from elsewhere on a shared host falls on all alike), and records the bytes each rank sent
(P2P and collective, from the ``CommLedger``), the communication calls, the
peak memory, and the largest error against a float64 reference. It also
times a few kernel calls, elementwise buffer operations, P2P exchanges and
all-gathers, fits the cost
model's constants to them (``planner.calibrate``) and prints the calibrated
model's prediction beside each measured time.

Peak memory (``--memory``, largest over ranks): on CUDA
``torch.cuda.max_memory_allocated`` over one iteration; on CPU by default the
peak of live tensor bytes during one iteration, tracked at PyTorch's
dispatch level (``MemTracker``: tensors only, no allocator slack); ``--memory rss`` uses the
resident-set high-water growth instead (see ``PeakMemory``).

Overlap (CPU ranks): each row's ``hidden`` is, per rank, the fraction of its
transfers' time spent in flight while the rank did other work rather than blocked
in a wait (``CommLedger.waits``). ``--comm-delay-ms D`` also times every strategy
with each transfer slowed to take at least D ms, once overlapped and once with
every transfer waited on as it starts (``comm.CommOptions``), in the same rounds;
``--comm-delay-ms-per-mib M`` adds M ms per MiB the transfer moves (a link of finite
bandwidth: larger transfers take longer). ``--own-rows-first on|off`` sets
StarTrail's first-step split (``CommOptions(own_rows_first=)``) for a comparison.

Outputs: a table on stdout, ``--json`` (all numbers), ``--png`` (time and
bytes per strategy). Runs on CPU with gloo (spawns ``--nproc`` ranks), or
under ``torchrun`` (NCCL on GPUs, one rank per GPU), or on an emulated multi-node
cluster: ``--emulate NODESxRANKS --inter-node RATE [--intra-node RATE]`` (root; network
namespaces joined by rate-limited links, ``bench/emulated.py``), which adds the link
probe and the cost model's prediction for that cluster beside each measured median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cli_options import add_own_rows_first
from ..emulate import EmulationSpec
from ..planner.strategies import candidate_strategies
from ..spawn import spawn_local_ranks
from .extensions import STALE_LOCK_S, extensions_dir, remove_stale_locks
from .memory import PeakMemory
from .report import format_table, write_png
from .runner import DTYPES, auto_placement_names, run_rank

__all__ = ["WORKLOADS", "build_parser", "main", "resolve_workload", "run"]

WORKLOADS: dict[str, dict] = {
    "gpt": {"heads": 8, "kv_heads": None, "head_dim": 64, "full": False},
    "dit": {"heads": 8, "kv_heads": None, "head_dim": 64, "full": True},
}
"""Default attention shapes per workload (``kv_heads`` None: as many as ``heads``)."""


def _bench_rank(rank: int, world: int, args, out_file: str) -> None:
    report = run_rank(rank, world, args)
    if report is not None:
        with open(out_file, "w") as f:
            json.dump(report, f)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="startrail-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc", type=int, default=4, help="CPU ranks to spawn (ignored under torchrun)"
    )
    p.add_argument("--seq-len", type=int, default=4096, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="gpt",
        help="gpt: causal, 8 heads of 64; dit: DiT-1B's attention (full, head_dim 64) with "
        "its 24 heads reduced to 8 for CPU ranks; --heads/--kv-heads/--head-dim/--full override. "
        "memory: the whole training step's peak memory against the sequence length, a "
        "benchmark of its own ('--workload memory --help')",
    )
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--full", action="store_true", help="no causal mask (default: causal, zigzag)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--memory",
        choices=["auto", *PeakMemory.METHODS],
        default="auto",
        help="peak-memory method (auto: cuda on GPUs, tracker on CPU)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--comm-delay-ms",
        type=float,
        default=0.0,
        help="also time every strategy with each transfer slowed to take at least this long "
        "(CPU ranks), overlapped and with overlap off, side by side (0: off)",
    )
    p.add_argument(
        "--comm-delay-ms-per-mib",
        type=float,
        default=0.0,
        help="also time every strategy with each transfer slowed by this many ms per MiB "
        "it moves (added to --comm-delay-ms), side by side as that option (0: off)",
    )
    add_own_rows_first(p)
    p.add_argument("--strategies", nargs="*", help="only these names (e.g. ring startrail-C2-team)")
    p.add_argument(
        "--auto-placement",
        action="store_true",
        help="also run StarTrail under the placement map computed for the ranks' nodes "
        "(placement='auto', found by hostname) at every valid C > 1: 'startrail-C<C>-map' "
        "(with --emulate: on the cost model of the emulated links, from its first probe)",
    )
    p.add_argument(
        "--placement-cluster-json",
        default=None,
        help="with --auto-placement: the cluster (a ClusterSpec as JSON) whose rates the map "
        "search uses (default: the planner's AUTO_CLUSTER preset; --emulate writes one)",
    )
    p.add_argument(
        "--timed-kernels",
        default=None,
        metavar="GFLOPS",
        help="CPU ranks: each kernel call waits its modelled time at GFLOPS per rank instead "
        "of computing (Note [timed kernels]): the ranks compute side by side, as on "
        "accelerators; implies --no-check. 0: the host's nominal rate shared by the ranks; "
        "a cluster preset (with --emulate, e.g. h100-ib): the rate that gives an emulated "
        "node the preset's ratio of attention FLOP/s to off-node bytes/s",
    )
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--emulate",
        metavar="NODESxRANKS",
        help="run on an emulated cluster of NODES network namespaces with RANKS ranks each "
        "(root; replaces --nproc), e.g. 4x2",
    )
    p.add_argument(
        "--inter-node",
        metavar="RATE",
        default="200mbit",
        help="with --emulate: each node's link, each direction (kbit, mbit, gbit)",
    )
    p.add_argument(
        "--intra-node",
        metavar="RATE",
        default=None,
        help="with --emulate: a limit on the links inside a node (default: none)",
    )
    p.add_argument("--timeout", type=float, default=600, help="per-collective timeout, s")
    p.add_argument("--json", default="bench_attention.json", help="output JSON ('' = none)")
    p.add_argument("--png", default="bench_attention.png", help="output chart ('' = none)")
    return p


def resolve_workload(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the shape arguments not given from ``--workload``'s defaults (in place)."""
    wl = WORKLOADS[args.workload]
    for name in ("heads", "head_dim"):
        if getattr(args, name) is None:
            setattr(args, name, wl[name])
    if args.kv_heads is None:
        args.kv_heads = args.heads
    args.full = args.full or wl["full"]
    return args


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the benchmark, print and write the outputs; exit status 0.
    ``--workload memory`` is the whole training step's memory (``step_memory.py``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = _without_memory_workload(argv)
    if rest is not None:
        from .step_memory import main as memory_main

        return memory_main(rest)
    run(argv)
    return 0


def _without_memory_workload(argv: list[str]) -> list[str] | None:
    """``argv`` less ``--workload memory`` when it asks for the memory workload, else None."""
    for i, a in enumerate(argv):
        if a == "--workload=memory":
            return argv[:i] + argv[i + 1 :]
        if a == "--workload" and i + 1 < len(argv) and argv[i + 1] == "memory":
            return argv[:i] + argv[i + 2 :]
    return None


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value (``FLAG V`` or ``FLAG=V``; the last one, as argparse
    reads it) replaced by ``value``. Pure."""
    out = list(argv)
    for i in reversed(range(len(out))):
        if out[i] == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if out[i].startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return out


def _timed_rate(p, value: str, spec, world: int) -> float:
    """``--timed-kernels``' rate per rank (FLOP/s): GFLOP/s given, 0 for the host's nominal
    rate shared by the ranks, or a cluster preset's node ratio on the emulated node link
    (``timed_kernel.timed_rate``, with ``--emulate``); ``p.error`` naming the flag."""
    from ..planner.cluster import CLUSTER_PRESETS
    from .emulated import NOMINAL_HOST_FLOPS
    from .timed_kernel import timed_rate

    try:
        rate = timed_rate(value, spec)
    except ValueError as e:
        p.error(f"--timed-kernels {value}: {e}")
    if rate is None:
        p.error(
            f"--timed-kernels {value} must be a finite number >= 0 (GFLOP/s; 0: nominal) or, "
            f"with --emulate, a cluster preset: {sorted(CLUSTER_PRESETS)}"
        )
    return rate or NOMINAL_HOST_FLOPS / world


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark and return the report (rank 0's; ``{}`` on other torchrun ranks)."""
    p = build_parser()
    args = resolve_workload(p.parse_args(argv))
    under_torchrun = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    spec = None
    if args.emulate:
        if under_torchrun:
            p.error("--emulate starts its own ranks: run it without torchrun")
        spec = EmulationSpec.from_flags(p, args.emulate, args.inter_node, args.intra_node)
        world = spec.world_size
    args.cuda = under_torchrun and torch.cuda.is_available()
    for name in ("warmup", "threads"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    for flag in ("comm_delay_ms", "comm_delay_ms_per_mib"):
        v = getattr(args, flag)
        name = "--" + flag.replace("_", "-")
        if not (v >= 0 and math.isfinite(v)):
            p.error(f"{name} {v} must be a finite number >= 0")
        if v and args.cuda:
            p.error(
                f"{name} is for CPU ranks: on CUDA a host-side delay does not slow a "
                "transfer on its stream; allowed on CUDA: 0"
            )
    if world < 1:
        p.error("--nproc must be >= 1")
    args.timed_kernels_flops = None
    if args.timed_kernels is not None:
        args.timed_kernels_flops = _timed_rate(p, args.timed_kernels, spec, world)
        if args.cuda:
            p.error("--timed-kernels is for CPU ranks (an emulated cluster); on CUDA: unset")
        args.no_check = True
    if args.seq_len % (2 * world):
        p.error(f"--seq-len {args.seq_len} must be divisible by 2*nproc = {2 * world}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.strategies:
        known = {s.name for s in candidate_strategies(world, args.heads, args.kv_heads)}
        if args.auto_placement:
            known |= set(auto_placement_names(world))
        bad = [s for s in args.strategies if s not in known]
        if bad:
            p.error(f"--strategies {bad} not valid here; allowed: {sorted(known)}")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.cuda else "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir(os.environ))
    for lock in remove_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"]):
        print(
            f"removed {lock}, a killed build's: untouched for {STALE_LOCK_S:.0f} s", file=sys.stderr
        )
    if spec is not None:
        from .emulated import format_emulation, run_emulated

        given = list(sys.argv[1:] if argv is None else argv)
        if args.timed_kernels_flops is not None:  # the ranks, without --emulate, get the rate
            given = _with_flag(given, "--timed-kernels", repr(args.timed_kernels_flops / 1e9))
        report = run_emulated(spec, given, 4 * args.timeout)  # rank 0 printed its table
        print(format_emulation(report))
    elif under_torchrun:
        if args.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if args.cuda else "gloo")
        try:
            report = run_rank(dist.get_rank(), world, args)
        finally:
            dist.destroy_process_group()
        if report is None:
            return {}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "report.json")
            spawn_local_ranks(
                _bench_rank,
                world,
                args,
                out_file,
                timeout=timedelta(seconds=args.timeout),
                threads=args.threads,
            )
            with open(out_file) as f:
                report = json.load(f)
    if spec is None:
        print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        write_png(report, args.png)
        print(f"wrote {args.png}")
    return report
