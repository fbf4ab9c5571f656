"""``startrail-plan``: predicted time, bytes and memory of every (C, placement) and the peers.

    startrail-plan --cluster h100-ib --model gpt-7b --seq-len 64K --cp-size 32
    startrail-plan --cluster a100-eth --nodes 4 --model llama3-8b --seq-len 128K --cp-size 32 --json
    startrail-plan --cluster h100-ib --inter-bw 100 --inter-bw-per-gpu 12.5 --hidden 4096 \\
        --heads 32 --kv-heads 8 --layers 32 --ffn-hidden 14336 --seq-len 256K --cp-size 64

Presets are starting points; every number can be overridden. Bandwidths in
GB/s (1e9 bytes), latencies in microseconds, throughputs in TFLOP/s. ``--cluster-json
FILE`` starts from a saved cluster instead: a ``ClusterSpec``'s fields as JSON, or a
benchmark report (``startrail-bench --json``), whose emulated cluster (``--emulate``) or
else calibrated one is taken. ``--dtype`` sets the element size (default bf16).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..cli_options import add_own_rows_first
from ..schedule import OWN_ROWS_FIRST_SETTINGS
from .cluster import CLUSTER_PRESETS, MODEL_PRESETS, ClusterSpec, ModelSpec
from .memory import StepFeatures
from .plan import Plan, plan

_CLUSTER_OVERRIDES = {
    # flag: (field, scale)
    "gpus_per_node": ("gpus_per_node", None),
    "nodes": ("num_nodes", None),
    "intra_bw": ("intra_bw", 1e9),
    "intra_latency": ("intra_latency", 1e-6),
    "inter_bw": ("inter_bw", 1e9),
    "inter_bw_per_gpu": ("inter_bw_per_gpu", 1e9),
    "inter_latency": ("inter_latency", 1e-6),
    "attn_tflops": ("attn_flops", 1e12),
    "matmul_tflops": ("matmul_flops", 1e12),
    "gpu_memory": ("gpu_memory", 2**30),
    "causal_tile_waste": ("causal_tile_waste", 1.0),
}
_MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def named_cluster(name: str, setting: str, ranks: int | None = None) -> ClusterSpec:
    """The cluster ``name`` names: a preset of ``CLUSTER_PRESETS`` (with ``ranks``, its nodes
    holding ``min(ranks, 8)`` of them) or a cluster JSON file (``load_cluster``);
    ``ValueError`` naming ``setting`` (a flag or config key) otherwise."""
    if name in CLUSTER_PRESETS:
        spec = CLUSTER_PRESETS[name]
        return spec if ranks is None else spec.with_(gpus_per_node=min(ranks, 8))
    try:
        return load_cluster(name)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{setting}: neither a preset ({sorted(CLUSTER_PRESETS)}) nor a cluster JSON file ({e})"
        ) from None


def load_cluster(path: str) -> ClusterSpec:
    """A ``ClusterSpec`` from ``path``: its fields as JSON, or a ``startrail-bench`` report
    (the emulated cluster's ``emulation.cluster_median``, else ``calibration.cluster_median``).
    ``ValueError`` naming the file and what is missing otherwise."""
    with open(path) as f:
        data = json.load(f)
    if "emulation" in data:
        data = data["emulation"]["cluster_median"]
    elif "calibration" in data:
        data = data["calibration"]["cluster_median"]
    try:
        return ClusterSpec(**data)
    except TypeError as e:
        raise ValueError(f"--cluster-json {path}: not a cluster description ({e})") from None


def parse_size(text: str) -> int:
    """``65536``, ``64K``, ``1M`` -> tokens (K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65536, 64K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="startrail-plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster", choices=sorted(CLUSTER_PRESETS), default="h100-ib")
    p.add_argument(
        "--cluster-json",
        metavar="FILE",
        help="a saved cluster (ClusterSpec fields) or a startrail-bench report to start from",
    )
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    for flag in _CLUSTER_OVERRIDES:
        kind = int if flag in ("gpus_per_node", "nodes") else float
        p.add_argument(f"--{flag.replace('_', '-')}", type=kind, help="override the preset")
    p.add_argument("--no-overlap", action="store_true", help="communication never overlaps")
    add_own_rows_first(p)
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="gpt-7b")
    for f in _MODEL_FIELDS:
        p.add_argument(f"--{f.replace('_', '-')}", type=int, help="override the model preset")
    p.add_argument("--gated-mlp", action="store_true", default=None)
    p.add_argument("--seq-len", type=parse_size, required=True, help="global tokens (64K ok)")
    p.add_argument("--cp-size", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--no-recompute",
        action="store_true",
        help="no activation recompute (default: full checkpointing, forward rerun in backward)",
    )
    g = p.add_argument_group(
        "whole-step memory (the memory column then counts the logits, the loss and every "
        "layer's kept activations under these options, as the Megatron adapter runs them)"
    )
    g.add_argument("--step-memory", action="store_true", help="with none of the options below")
    g.add_argument("--selective-recompute", action="store_true", help="core attention only")
    g.add_argument("--tiled-loss", type=int, default=None, metavar="TOKENS")
    g.add_argument("--tiled-mlp", type=int, default=None, metavar="TOKENS")
    g.add_argument(
        "--attention-tile",
        type=int,
        default=None,
        metavar="TOKENS",
        help="StarTrail's kernel calls at most TOKENS x TOKENS (--startrail-attention-tile)",
    )
    g.add_argument(
        "--attention-head-chunks",
        type=int,
        default=1,
        metavar="N",
        help="StarTrail's attention on N KV-head groups one after the other "
        "(--startrail-attention-head-chunks)",
    )
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    p.add_argument(
        "--window",
        type=parse_size,
        default=None,
        help="a causal sliding window of this many tokens on every layer (4K ok); StarTrail "
        "is charged the window's pairs and the sub-ring steps it runs, the peers the pairs",
    )
    p.add_argument(
        "--no-map-search",
        action="store_true",
        help="only the named placements (default: also the placement map computed for the "
        "cluster's nodes, where the CP ranks span several and it beats both)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def format_plan(pl: Plan) -> str:
    gib, mib = 2**30, 2**20
    m = pl.model
    lines = [
        f"cluster: {pl.cluster.name} ({pl.cluster.num_nodes} x {pl.cluster.gpus_per_node} GPUs, "
        f"{pl.cluster.gpu_memory / gib:.0f} GiB each)",
        f"model: {m.name} ({m.layers} layers, hidden {m.hidden}, {m.heads} heads, "
        f"{m.kv_heads} kv heads), seq {pl.seq_len}, batch {pl.batch}, CP {pl.cp_size}",
        f"{'strategy':28s}{'attn ms':>9s}{'layer ms':>10s}{'step s':>8s}"
        f"{'P2P MiB':>10s}{'coll MiB':>10s}{'mem GiB':>9s}  fits",
    ]
    for r in pl.rows:
        mark = " <- recommended" if pl.recommended is r else ""
        lines.append(
            f"{r.strategy:28s}{r.attn_s * 1e3:9.2f}{r.layer_s * 1e3:10.2f}{r.step_s:8.2f}"
            f"{r.p2p_bytes / mib:10.0f}{r.collective_bytes / mib:10.0f}"
            f"{r.memory_bytes / gib:9.1f}  {'yes' if r.fits else 'NO'}{mark}"
        )
    ring = next((r for r in pl.rows if r.strategy == "ring"), None)
    if pl.recommended is None:
        lines.append("no StarTrail configuration fits in GPU memory")
    elif ring is not None:
        lines.append(
            f"recommended: {pl.recommended.strategy} (C={pl.recommended.team_size}, "
            f"placement {pl.recommended.placement}, U={pl.recommended.ulysses_size}), predicted "
            f"{ring.layer_s / pl.recommended.layer_s:.2f}x ring's layer throughput, "
            f"{ring.step_s / pl.recommended.step_s:.2f}x its iteration throughput"
        )
    if pl.fastest is not None and pl.fastest is not pl.recommended:
        lines.append(f"fastest overall (peers included): {pl.fastest.strategy}")
    mapped = [r for r in pl.rows if r.strategy in pl.maps]
    if mapped:  # the recommended map, else the fastest one computed
        rec = pl.recommended if pl.recommended in mapped else min(mapped, key=lambda r: r.layer_s)
        lines.append(_map_picture(pl, rec))
    lines.append(
        "times: one layer forward+backward (layer; with recompute unless --no-recompute) and "
        f"one training iteration (step: all layers, LM head, optimizer and "
        f"{pl.rows[0].grad_sync_s:.2f} s of ZeRO-2 gradient/parameter collectives), per rank; "
        "bytes: max over ranks, fwd+bwd; mem: peak per rank with ZeRO-2 and "
        + (
            "the whole step's activations (logits and loss included, --step-memory options)"
            if pl.features is not None
            else "full checkpointing (attention layer only; --step-memory: the whole step)"
        )
    )
    return "\n".join(lines)


def _map_picture(pl: Plan, rec) -> str:
    """The recommended map as nodes and ranks: each node's CP ranks with the logical
    coordinate (team.member) and sub-ring each runs (the split: its ring group's ranks)."""
    from .placement import format_map
    from .times import ring_cluster

    m, u = pl.maps[rec.strategy], rec.ulysses_size
    cl = ring_cluster(pl.cluster, u) if u > 1 else pl.cluster
    head = (
        f"placement map of {rec.strategy} (rN=tT.A/sS: CP rank N runs team T, member A, sub-ring S"
    )
    head += (
        f"; ring ranks of one Ulysses member, CP rank = ring rank x {u} + member)" if u > 1 else ")"
    )
    return head + ":\n" + format_map(m, rec.team_size, [cl.node(r) for r in range(len(m))])


def _features(args):
    """``StepFeatures`` from the whole-step memory flags, or None when none is given."""
    on = (
        args.step_memory,
        args.selective_recompute,
        args.tiled_loss is not None,
        args.tiled_mlp is not None,
        args.attention_tile is not None,
        args.attention_head_chunks != 1,
        args.cross_entropy_loss_fusion,
    )
    if not any(on):
        return None
    if args.selective_recompute and args.no_recompute:
        raise ValueError("--selective-recompute and --no-recompute: give one")
    recompute = "none" if args.no_recompute else "selective" if args.selective_recompute else "full"
    return StepFeatures(
        recompute=recompute,
        tiled_loss=args.tiled_loss,
        tiled_mlp=args.tiled_mlp,
        attention_tile=args.attention_tile,
        attention_head_chunks=args.attention_head_chunks,
        ce_fusion=args.cross_entropy_loss_fusion,
    )


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    cluster = CLUSTER_PRESETS[args.cluster]
    if args.cluster_json:
        try:
            cluster = load_cluster(args.cluster_json)
        except (OSError, ValueError) as e:
            p.error(str(e))
    changes = {}
    for flag, (field, scale) in _CLUSTER_OVERRIDES.items():
        v = getattr(args, flag)
        if v is not None:
            changes[field] = v * scale if scale else v
    if args.no_overlap:
        changes["overlap"] = False
    if args.own_rows_first != "auto":
        changes["own_rows_first"] = OWN_ROWS_FIRST_SETTINGS[args.own_rows_first]
    base = MODEL_PRESETS[args.model]
    mchanges = {f: getattr(args, f) for f in _MODEL_FIELDS if getattr(args, f) is not None}
    if args.gated_mlp is not None:
        mchanges["gated_mlp"] = True
    try:
        if changes:
            cluster = cluster.with_(**changes, name=f"{cluster.name} (modified)")
        model = ModelSpec(
            **{**base.__dict__, **mchanges, "name": base.name + ("*" if mchanges else "")}
        )
        result = plan(
            cluster,
            model,
            args.seq_len,
            args.cp_size,
            batch=args.batch,
            elem_bytes=DTYPE_BYTES[args.dtype],
            recompute=not args.no_recompute,
            window=args.window,
            features=_features(args),
            map_search=not args.no_map_search,
        )
    except ValueError as e:
        p.error(str(e))
    if args.json:
        json.dump(result.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(format_plan(result))
    return 0
