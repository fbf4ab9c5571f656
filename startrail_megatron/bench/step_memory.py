"""The whole training step's peak memory per rank against the sequence length.

    startrail-bench --workload memory                    # or: --workload memory --help

Each configuration (``CONFIGS``: no feature, Megatron's own options that run on CPU,
each of StarTrail's tilings alone, everything) trains the same GPT (default 4 layers,
hidden 256, 8 heads in 2 query groups, SwiGLU, vocabulary 50,257; mock data) with our
entry point at CP = ``--nproc`` under StarTrail, two iterations at each ``--seq-lens``
global length, every run a fresh set of ranks. The figure is the second iteration's peak
(the optimizer state exists by then), the largest over ranks, as the entry point's
``--log-peak-memory`` logs it: on CPU ``live`` by default (the peak bytes of every live
tensor, those alive at the step's start included: ``bench/memory.py``'s
``LiveTensorBytes``, the CPU's counterpart of ``torch.cuda.max_memory_allocated``), or
``--method rss`` (the resident set's high-water mark, interpreter included; glibc is told
to give large blocks back at once, ``MALLOC_MMAP_THRESHOLD_``). Before any run the method
reads a known allocation in this process, and the benchmark stops if it is off by more
than 1 %.

The entry point also logs the peak inside the transformer layers (their forward and
backward: ``decoder``) and outside them (``rest``: embedding, logits and loss, optimizer),
and a step's peak is the larger of the two. A least-squares line through each phase's
three longest points gives its fixed part and slope (bytes per local token); the whole
step's slope is the steeper phase's, the one that holds the peak at long sequences (at
short ones a fixed cost such as the loss's tile can hold it and hide the layers' slope).
The largest residual of the measured step peaks against the larger line is printed.
From the lines, the longest global sequence under
``--budget-mib`` per rank (both phases under it); with ``--longest`` (default) that length is then trained once
(its losses and measured peak printed, the peak checked against the budget). The losses
of every configuration at each length are compared with the plain run's. With
``--extra-vocab V`` the plain and the all-features configurations also run at vocabulary
V, so the slope's dependence on the vocabulary shows. Outputs: a table on stdout,
``--json`` (every run), ``--png`` (peak against local tokens, with the lines).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .memory import PHASES, PeakMemory
from .step_memory_report import MIB, format_table, write_png

__all__ = ["CONFIGS", "build_parser", "fit_line", "longest_sequence", "main", "run"]

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
RECOMPUTE += ["--recompute-num-layers", "1"]
CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "ce-fusion": ["--cross-entropy-loss-fusion"],
    "selective": ["--recompute-activations"],
    "recompute": RECOMPUTE,
    "tiled-loss": ["--startrail-tiled-loss", "{tile}"],
    "tiled-mlp": ["--startrail-tiled-mlp", "{tile}"],
    "attention-tile": ["--startrail-attention-tile", "{attention_tile}"],
    "head-chunks": ["--startrail-attention-head-chunks", "{head_chunks}"],
    "all": RECOMPUTE
    + ["--startrail-tiled-loss", "{tile}", "--startrail-tiled-mlp", "{tile}"]
    + ["--startrail-attention-tile", "{attention_tile}"]
    + ["--startrail-attention-head-chunks", "{head_chunks}"],
}
"""Configuration name -> the entry point's flags (``{tile}``: ``--tile``,
``{attention_tile}``: ``--attention-tile``, each at most the local sequence;
``{head_chunks}``: ``--head-chunks``). ``ce-fusion`` and the recomputes are megatron-core's
own options."""

FIT_POINTS = 3
"""The line is fitted through the longest lengths only: at short ones a fixed cost (a
tile's logits, say) can hold the peak, and the slope there understates the long run's."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="startrail-bench --workload memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=4, help="CP ranks (CP = nproc)")
    p.add_argument("--team-size", type=int, default=2, help="StarTrail's C")
    p.add_argument(
        "--seq-lens",
        default="1024,2048,4096,6144,8192",
        help="global sequence lengths, comma-separated",
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {list(CONFIGS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--query-groups", type=int, default=2)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--extra-vocab", type=int, default=None, help="also run plain and all here")
    p.add_argument("--tile", type=int, default=64, help="tokens per tile of the tilings")
    p.add_argument(
        "--attention-tile",
        type=int,
        default=512,
        help="tokens per side of the attention's largest kernel call (attention-tile, all)",
    )
    p.add_argument(
        "--head-chunks",
        type=int,
        default=2,
        help="KV-head groups the attention runs one after the other (head-chunks, all)",
    )
    p.add_argument(
        "--optimizer",
        choices=["sgd", "adam"],
        default="sgd",
        help="sgd (default): model states of 8 bytes per parameter, so the budget limits "
        "activations; adam adds two moments and, on CPU, the step's temporaries",
    )
    p.add_argument("--budget-mib", type=float, default=384.0, help="per-rank memory budget")
    p.add_argument(
        "--longest",
        default="all-configs",
        help="configurations to train once at their longest length under the budget "
        "('all-configs', 'none', or a comma-separated list)",
    )
    p.add_argument("--method", choices=["live", "rss"], default="live")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per training run")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    return p


def _flags(args, config: str, seq: int, vocab: int) -> list[str]:
    tile = str(min(args.tile, seq // args.nproc))
    att = str(min(args.attention_tile, seq // args.nproc))
    base = [
        "--nproc", str(args.nproc), "--context-parallel-size", str(args.nproc),
        "--context-parallel-impl", "startrail", "--startrail-team-size", str(args.team_size),
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--group-query-attention",
        "--num-query-groups", str(args.query_groups), "--swiglu", "--vocab-size", str(vocab),
        "--micro-batch-size", "1", "--mock-data", "--lr", "3e-4", "--train-iters", "2",
        "--optimizer", args.optimizer,
        "--seq-length", str(seq), "--log-peak-memory", args.method,
    ]  # fmt: skip
    return base + [
        f.replace("{tile}", tile)
        .replace("{attention_tile}", att)
        .replace("{head_chunks}", str(args.head_chunks))
        for f in CONFIGS[config]
    ]


def run_one(args, config: str, seq: int, vocab: int) -> dict:
    """Train one configuration at one length; its losses and the second iteration's peak."""
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "log.json")
        cmd = [sys.executable, "-m", "startrail_megatron.pretrain_gpt"]
        cmd += _flags(args, config, seq, vocab) + ["--log-json", log]
        env = dict(os.environ)
        if args.method == "rss":  # large blocks back to the system when freed
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{config} at --seq-length {seq} failed (exit {proc.returncode}):\n"
                + proc.stderr[-3000:]
            )
        with open(log) as f:
            entries = json.load(f)
    return {
        "config": config,
        "seq_len": seq,
        "local_tokens": seq // args.nproc,
        "vocab": vocab,
        "peak_bytes": entries[-1]["peak_memory"],
        "peak_decoder_bytes": entries[-1].get("peak_memory_decoder"),
        "peak_rest_bytes": entries[-1].get("peak_memory_rest"),
        "losses": [e["loss"] for e in entries],
        "seconds": time.perf_counter() - t0,
    }


def planner_features(
    config: str, tile: int, attention_tile: int | None = None, head_chunks: int = 1
):
    """The planner's ``StepFeatures`` for one of ``CONFIGS`` (the entry point's hidden
    dropout is off by default: no masks)."""
    from ..planner.memory import StepFeatures

    recompute = {"recompute": "full", "all": "full", "selective": "selective"}.get(config, "none")
    return StepFeatures(
        recompute=recompute,
        tiled_loss=tile if config in ("tiled-loss", "all") else None,
        tiled_mlp=tile if config in ("tiled-mlp", "all") else None,
        attention_tile=attention_tile if config in ("attention-tile", "all") else None,
        attention_head_chunks=head_chunks if config in ("head-chunks", "all") else 1,
        ce_fusion=config == "ce-fusion",
        dropout=False,
    )


def planner_slopes(report: dict) -> dict[str, dict]:
    """The planner's bytes per local token (``planner.memory.step_bytes_per_token``) for
    each result of a report, at its longest measured length, beside the measured slope."""
    from ..planner.cluster import ModelSpec
    from ..planner.memory import startrail_buffers, step_bytes_per_token
    from ..planner.shape import AttnShape

    m = report["model"]
    h, heads, groups = m["hidden"], m["heads"], m["query_groups"]
    ffn = int((4 * h * 2 / 3) / 64) * 64  # Megatron-LM's SwiGLU size
    out = {}
    for key, r in report["results"].items():
        vocab = -(-(r["vocab"] + 1) // 128) * 128  # the end-of-document id, padded as Megatron
        model = ModelSpec("bench", m["layers"], h, heads, groups, ffn, gated_mlp=True, vocab=vocab)
        local = max(x["local_tokens"] for x in report["runs"] if x["config"] == r["config"])
        shape = AttnShape(m["cp"], local, 1, heads, groups, h // heads, elem_bytes=4)
        att = m.get("attention_tile")  # None: a report from before the attention's tile
        feats = planner_features(
            r["config"], min(m["tile"], local), None if att is None else min(att, local),
            m.get("head_chunks", 1),  # 1: a report from before the head chunks
        )  # fmt: skip
        per = step_bytes_per_token(
            shape,
            model,
            m["team_size"],
            startrail_buffers(
                m["team_size"], shape, feats.attention_tile, feats.attention_head_chunks
            ),
            feats,
        )
        measured = r["slope_bytes_per_token"]
        out[key] = {
            "planner": per,
            "measured": measured,
            "error": per["step"] / measured - 1 if measured > 0 else None,
        }
    return out


def fit_line(points: list[tuple[float, float]]) -> dict:
    """Least squares ``y = fixed + slope * x``; with the largest residual."""
    n = len(points)
    if n < 2:
        raise ValueError(f"a line needs at least 2 lengths, got {n}")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("a line needs at least 2 different lengths")
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    fixed = my - slope * mx
    resid = max(abs(y - fixed - slope * x) for x, y in points)
    return {"fixed_bytes": fixed, "slope_bytes_per_token": slope, "max_residual_bytes": resid}


def phase_lines(runs: list[dict]) -> dict:
    """The lines of one configuration: one per phase (the transformer layers' forward and
    backward, ``decoder``; everything else, ``rest``: embedding, logits and loss, optimizer),
    each through its three longest points, and the whole step's: the steeper phase line
    (the one that holds the peak at long sequences), with the largest residual of the
    whole step's peaks against ``max`` of the phase lines."""
    out: dict = {}
    for ph in PHASES:
        pts = sorted((r["local_tokens"], r[f"peak_{ph}_bytes"]) for r in runs)
        if any(y is None for _, y in pts):
            continue
        out[ph] = fit_line(pts[-FIT_POINTS:])
    if not out:  # no phase peaks (a method without them): the step's own line
        pts = sorted((r["local_tokens"], r["peak_bytes"]) for r in runs)
        out["step"] = fit_line(pts[-FIT_POINTS:])
    steep = max(out.values(), key=lambda ln: ln["slope_bytes_per_token"])
    out["fixed_bytes"] = steep["fixed_bytes"]
    out["slope_bytes_per_token"] = steep["slope_bytes_per_token"]
    lines = [out[k] for k in (*PHASES, "step") if k in out]
    out["max_residual_bytes"] = max(
        abs(
            r["peak_bytes"]
            - max(
                ln["fixed_bytes"] + ln["slope_bytes_per_token"] * r["local_tokens"] for ln in lines
            )
        )
        for r in runs
    )
    return out


def longest_sequence(line: dict, budget_bytes: float, cp: int, multiple: int = 64) -> int:
    """The longest global sequence (a multiple of ``multiple``) whose predicted peak per
    rank is under the budget; 0 if even the fixed part is over it."""
    room = budget_bytes - line["fixed_bytes"]
    if room <= 0 or line["slope_bytes_per_token"] <= 0:
        return 0
    local = room / line["slope_bytes_per_token"]
    return int(local * cp) // multiple * multiple


def check_method(method: str) -> dict:
    """The method against a known allocation in this process: two 32 MiB tensors alive at
    once inside the region, 64 MiB above what an empty region reads. ``RuntimeError`` if
    more than 1 % off."""
    cpu = torch.device("cpu")
    _ = torch.ones(16) + 1  # the first operators' one-time setup is not the allocation
    with PeakMemory(cpu, method) as empty:
        pass
    with PeakMemory(cpu, method) as m:
        a = torch.ones(32 * MIB // 4)
        b = a + 1
        del a, b
    got = m.peak - (empty.peak if method == "live" else 0)  # rss: growth already
    if abs(got - 64 * MIB) > 0.01 * 64 * MIB:
        raise RuntimeError(f"the {method} method read {got / MIB:.2f} MiB for 64 MiB")
    return {"known_bytes": 64 * MIB, "read_bytes": got}


def run(argv: list[str] | None = None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"--configs {c!r} is not known; allowed: {list(CONFIGS)}")
    try:
        lens = sorted({int(s) for s in args.seq_lens.split(",") if s})
    except ValueError:
        p.error(f"--seq-lens {args.seq_lens!r}: give comma-separated integers")
    step = 2 * args.nproc
    bad = [s for s in lens if s % step or s // args.nproc < 1]
    if len(lens) < 2 or bad:
        p.error(f"--seq-lens needs >= 2 lengths, each a multiple of 2 x --nproc = {step}")
    if args.longest == "all-configs":
        longest = configs
    elif args.longest == "none":
        longest = []
    else:
        longest = [c for c in args.longest.split(",") if c]
        for c in longest:
            if c not in configs:
                p.error(f"--longest {c!r} is not among --configs {configs}")
    check = check_method(args.method)
    print(
        f"memory: {PeakMemory.METHODS[args.method]}; a known 64 MiB reads "
        f"{check['read_bytes'] / MIB:.2f} MiB",
        flush=True,
    )
    runs = []
    vocabs = [args.vocab] + ([args.extra_vocab] if args.extra_vocab else [])
    for vocab in vocabs:
        for seq in lens:
            for c in (
                configs if vocab == args.vocab else [c for c in configs if c in ("plain", "all")]
            ):
                r = run_one(args, c, seq, vocab)
                runs.append(r)
                print(
                    f"  {c:>10}  vocab {vocab:>6}  seq {seq:>6}  peak {r['peak_bytes'] / MIB:8.1f} MiB"
                    f"  losses {' '.join(f'{x:.6f}' for x in r['losses'])}  ({r['seconds']:.0f} s)",
                    flush=True,
                )
    results = {}
    for vocab in vocabs:
        for c in configs:
            mine = [r for r in runs if r["config"] == c and r["vocab"] == vocab]
            if len(mine) < 2:
                continue
            line = phase_lines(mine)
            key = c if vocab == args.vocab else f"{c}@{vocab}"
            plain = {
                r["seq_len"]: r["losses"]
                for r in runs
                if r["config"] == "plain" and r["vocab"] == vocab
            }
            diffs = [
                abs(a - b) / abs(b)
                for r in runs
                if r["config"] == c and r["vocab"] == vocab and r["seq_len"] in plain
                for a, b in zip(r["losses"], plain[r["seq_len"]])
            ]
            results[key] = {
                **line,
                "config": c,
                "vocab": vocab,
                "flags": CONFIGS[c],
                "longest_seq_len": min(
                    longest_sequence(line[ph], args.budget_mib * MIB, args.nproc)
                    for ph in (*PHASES, "step")
                    if ph in line
                ),
                "loss_rel_diff_vs_plain": max(diffs) if diffs else None,
            }
    for c in longest:
        res = results[c]
        seq = res["longest_seq_len"]
        if seq < 2 * args.nproc:
            continue
        seq -= seq % (2 * args.nproc)
        r = run_one(args, c, seq, args.vocab)
        res["longest_run"] = r
        res["longest_run_within_budget"] = r["peak_bytes"] <= args.budget_mib * MIB
        print(
            f"  longest {c:>10}: seq {seq} ({seq // args.nproc} per rank)  peak "
            f"{r['peak_bytes'] / MIB:.1f} MiB of {args.budget_mib:.0f}  losses "
            f"{' '.join(f'{x:.6f}' for x in r['losses'])}  ({r['seconds']:.0f} s)",
            flush=True,
        )
    report = {
        "model": {
            "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "query_groups": args.query_groups, "vocab": args.vocab, "swiglu": True,
            "cp": args.nproc, "team_size": args.team_size, "tile": args.tile,
            "attention_tile": args.attention_tile,
            "head_chunks": args.head_chunks,
            "optimizer": args.optimizer,
        },
        "method": PeakMemory.METHODS[args.method],
        "method_check": check,
        "budget_bytes": args.budget_mib * MIB,
        "runs": runs,
        "results": results,
    }  # fmt: skip
    for key, cmp in planner_slopes(report).items():
        results[key]["planner_bytes_per_token"] = cmp["planner"]["step"]
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png:
        write_png(report, args.png)
    return report


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0
