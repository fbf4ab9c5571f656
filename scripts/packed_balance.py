"""What StarTrail computes and sends for a packed batch, against one dense causal sequence.

    python scripts/packed_balance.py [--docs 64] [--tokens 65536] [--cp-size 16] [--seed 0]

Pure arithmetic (no torch.distributed, no kernels run): the documents' lengths are drawn
from a long-tailed (log-normal) distribution and scaled to about ``--tokens`` tokens; the
packed layout pads each to a multiple of 2P (``pack_lengths``). For each team size C the
script counts, from the calls the attention makes (``schedule.startrail_step_rows``), the
(query, key) pairs each rank computes (the masked half of diagonal tiles included, as the
kernels compute them), the kernel calls (one per document and block, as on CPU and the SDPA
kernels; and grouped, one per block-plan call, as flash-attn's varlen functions and TE's
THD format take them: ``schedule.startrail_step_varlen``), and the P2P and collective bytes per rank of one
forward and backward (``accounting``), and prints them beside the same tokens as one dense
causal sequence and beside the pairs the documents really need. The table in
docs/performance.md ("Packed documents") is this script's output.
"""

from __future__ import annotations

import argparse
import math
import random

from startrail_megatron.accounting import LocalShape, startrail_comm_bytes
from startrail_megatron.schedule import startrail_step_rows, startrail_step_varlen
from startrail_megatron.schedule.layout import StarTrailLayout, valid_team_sizes
from startrail_megatron.schedule.packing import pack_lengths


def long_tailed_lengths(n_docs: int, tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    raw = [rng.lognormvariate(0.0, 1.5) for _ in range(n_docs)]
    scale = tokens / sum(raw)
    return [max(1, round(x * scale)) for x in raw]


def rank_work(lay: StarTrailLayout, s_local: int, packed) -> list[tuple[int, int, int]]:
    """[rank] -> ((q, k) pairs computed, kernel calls, varlen kernel calls) over every step,
    per (batch, head)."""
    out = []
    for r in range(lay.cp_size):
        pairs = calls = grouped = 0
        for step in range(lay.ring_size):
            if packed is not None:
                grouped += len(startrail_step_varlen(lay, r, step, True, packed))
            for call in startrail_step_rows(lay, r, step, True, s_local, packed):
                pairs += call.pairs()
                calls += 1
        out.append((pairs, calls, grouped if packed is not None else calls))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--cp-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, default=32, help="query heads (gpt-7b: 32)")
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    P = args.cp_size
    lengths = long_tailed_lengths(args.docs, args.tokens, args.seed)
    packed = pack_lengths(lengths, P)
    n = sum(lengths)
    dense_s = -(-n // (2 * P)) * 2  # the same tokens as one sequence, padded to 2P only
    need = sum(m * (m + 1) // 2 for m in lengths)
    dense_pairs = dense_s * P * (dense_s * P + 1) // 2
    print(
        f"{args.docs} documents, {n} tokens (longest {max(lengths)}, median "
        f"{sorted(lengths)[len(lengths) // 2]}, shortest {min(lengths)}); packed: "
        f"{packed.total} tokens after padding each to 2P = {2 * P} "
        f"(+{packed.total / n - 1:.2%}); P = {P}; per (batch, head); bf16, "
        f"{args.heads} q / {args.kv_heads} kv heads of {args.head_dim}"
    )
    print(
        f"pairs the documents need: {need:.4g} ({need / dense_pairs:.2%} of one dense causal "
        f"sequence of the same tokens, {dense_pairs:.4g})"
    )
    hdr = (
        f"{'C':>2} {'layout':>6} {'pairs/rank max':>15} {'max/mean':>9} {'vs need/P':>10} "
        f"{'calls/rank':>10} {'varlen':>6} {'P2P MiB/rank':>13} {'coll MiB/rank':>14} {'P2P vs dense':>13}"
    )
    print(hdr)
    for c in valid_team_sizes(P):
        lay = StarTrailLayout(P, c)
        for name, lay_packed, s_local in (
            ("packed", packed, packed.s_local),
            ("dense", None, dense_s),
        ):
            work = rank_work(lay, s_local, lay_packed)
            pairs = [w[0] for w in work]
            calls = max(w[1] for w in work)
            grouped = max(w[2] for w in work)
            shape = LocalShape(s_local, 1, args.heads, args.kv_heads, args.head_dim, 2, 4)
            byts = [startrail_comm_bytes(lay, r, shape) for r in range(P)]
            p2p = max(b["fwd_p2p"] + b["bwd_p2p"] for b in byts)
            coll = max(b["fwd_collective"] + b["bwd_collective"] for b in byts)
            if name == "packed":
                packed_p2p = p2p
            ratio = "" if name == "packed" else f"{packed_p2p / p2p:13.3f}"
            print(
                f"{c:>2} {name:>6} {max(pairs):>15.4g} {max(pairs) / (sum(pairs) / P):>9.3f} "
                f"{max(pairs) / (need / P):>10.2f} {calls:>10} {grouped:>6} {p2p / 2**20:>13.1f} "
                f"{coll / 2**20:>14.1f} {ratio:>13}"
            )
    if not math.isfinite(need):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
