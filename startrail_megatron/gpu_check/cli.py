"""One-device check of every attention backend inside StarTrail, and its per-rank efficiency.

Run by ``scripts/gpu_check.sh`` (``python -m startrail_megatron.gpu_check``):

(a) correctness: for every backend name that can run on this device, the
    one-process StarTrail (``one_process.py``) forward and backward against a
    dense float64 reference of the same (rounded) inputs: max relative error
    of out, dq, dk, dv <= 2.5e-2 (bf16 MHA), 3.5e-2 (bf16 GQA), 5e-3 (fp16).
    ``CHECK_BACKENDS`` includes ``"te"`` (Transformer Engine), checked where TE
    is installed; a backend that cannot run is reported with the reason.
    Then, per backend, the attention variants (``check_features``): packed documents
    (the varlen / THD path on flash-attn and TE), a causal window with soft-capping,
    learned sinks, and dropout's reproducibility.
(b) timing: StarTrail's per-rank compute (kernel calls, merges, reorders; no
    communication) for P ranks and each team size C, against one call of the
    same backend over the whole sequence. Efficiency = t_whole / (P * t_rank),
    with t_rank the slowest rank ("max") or the ranks' mean ("mean"); 1.0 means
    splitting the sequence costs nothing. Peers' reference: zigzag ring
    attention reaches about 0.9 of single-GPU flash-attn on 8 H800.

``--cpu`` runs tiny sizes on the CPU (what CI runs); the default sizes are a
long-context GPT layer's: P = 8, C in {1, 2}, 8192 tokens per rank, head_dim 128, 32 query / 8
KV heads, bf16, causal. Prints a table, writes a JSON, exits 1 if any check
fails. A time budget skips the remaining timings rather than overrun.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

from ..kernels import BACKENDS
from .sizes import CHECK_BACKENDS, CPU_SIZES, GPU_SIZES
from .suite import run

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m startrail_megatron.gpu_check", description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (CI)")
    ap.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="skip timings that would start after this"
    )
    ap.add_argument("--no-timing", action="store_true", help="only the correctness checks")
    ap.add_argument(
        "--backends",
        default=",".join(CHECK_BACKENDS),
        help=f"comma-separated subset of {list(CHECK_BACKENDS)}",
    )
    args = ap.parse_args(argv)
    backends = tuple(b for b in args.backends.split(",") if b)
    bad = [b for b in backends if b not in CHECK_BACKENDS or b not in BACKENDS]
    if bad:
        ap.error(f"--backends: {bad} not known; allowed: {list(CHECK_BACKENDS)}")
    if args.cpu:
        device, sizes, mode = torch.device("cpu"), CPU_SIZES, "cpu"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu for the CPU mode", file=sys.stderr)
            return 2
        device, sizes, mode = torch.device("cuda", torch.cuda.current_device()), GPU_SIZES, "gpu"
    print(f"gpu_check mode={mode} device={device} torch={torch.__version__}", flush=True)
    rep = run(sizes, device, mode, args.budget_s, backends, timing=not args.no_timing)
    for key, why in rep.skipped_backends.items():
        print(f"SKIP {key}: {why}", flush=True)
    out = asdict(rep)
    out["passed"] = rep.passed
    out["sizes"] = {k: (str(v) if k == "dtypes" else v) for k, v in asdict(sizes).items()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    n_fail = sum(not c["passed"] for c in rep.checks)
    print(
        f"{'PASS' if rep.passed else 'FAIL'}: {len(rep.checks) - n_fail}/{len(rep.checks)} checks "
        f"passed, {len(rep.timing)} timings, {rep.wall_s:.1f} s; wrote {args.out}",
        flush=True,
    )
    return 0 if rep.passed else 1
