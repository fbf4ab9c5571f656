"""What StarTrail computes and sends under a sliding window, against full causal and ring.

    python scripts/window_cost.py [--seq 65536] [--cp-size 16] [--heads 32] [--kv-heads 8]

Pure arithmetic (no kernels run). For W = S/16, S/4 and S (a causal window of W tokens:
``window=(W - 1, 0)``) and every team size C, from the calls the attention makes
(``schedule.startrail_step_window_rows``): the (query, key) pairs inside the window that
each rank computes (what a kernel that skips tiles outside the band, flash-attn's window,
computes), the rectangles of those calls (what the CPU reference kernel computes), the
calls, the sub-ring steps run (``schedule.startrail_active_steps``: the steps in which
no rank of a sub-ring has work are skipped, their K,V sent straight past them), and the P2P
bytes per rank of one forward and backward (``accounting`` with those steps). Beside them:
the same for full causal attention and for ring (C = 1) with the same window, and what
contiguous shards with a halo exchange of the W - 1 keys before each rank's shard would
send instead. The table in docs/performance.md
("Sliding windows") is this script's output.
"""

from __future__ import annotations

import argparse

from startrail_megatron.accounting import LocalShape, startrail_comm_bytes
from startrail_megatron.schedule import (
    startrail_active_steps,
    startrail_step_rows,
    startrail_step_window_rows,
)
from startrail_megatron.schedule.layout import StarTrailLayout, valid_team_sizes


def work(lay: StarTrailLayout, s_local: int, window):
    """[rank] -> (pairs, rectangle area, calls)."""
    per_rank = []
    for r in range(lay.cp_size):
        pairs = area = calls = 0
        for step in range(lay.ring_size):
            if window is None:
                rows = startrail_step_rows(lay, r, step, True, s_local)
            else:
                rows = startrail_step_window_rows(lay, r, step, True, s_local, window)
            for call in rows:
                pairs += call.pairs()
                area += call.nq * call.nk
            calls += len(rows)
        per_rank.append((pairs, area, calls))
    return per_rank


def p2p_mib(lay: StarTrailLayout, shape: LocalShape, window) -> float:
    """The most P2P MiB a rank sends in one forward and backward, idle steps skipped."""
    active = startrail_active_steps(lay, True, shape.s_local, window)
    byts = [startrail_comm_bytes(lay, r, shape, active) for r in range(lay.cp_size)]
    return max(b["fwd_p2p"] + b["bwd_p2p"] for b in byts) / 2**20


def steps_run(lay: StarTrailLayout, s_local: int, window) -> str:
    """The most sub-ring steps a rank runs, of G."""
    active = startrail_active_steps(lay, True, s_local, window)
    most = lay.ring_size if active is None else max(len(x) for x in active)
    return f"{most}/{lay.ring_size}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--cp-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    P, S = args.cp_size, args.seq
    s_local = S // P
    shape = LocalShape(s_local, 1, args.heads, args.kv_heads, args.head_dim, 2, 4)
    kv_token = 2 * args.kv_heads * args.head_dim  # K and V elements per token
    print(
        f"S = {S} tokens, P = {P} (s_local {s_local}, chunks of {s_local // 2}); bf16, "
        f"{args.heads} q / {args.kv_heads} kv heads of {args.head_dim}; per rank, one "
        "forward + backward; pairs per (batch, head)"
    )
    hdr = (
        f"{'W':>6} {'C':>2} {'pairs/rank max':>15} {'max/mean':>8} {'vs causal':>9} "
        f"{'rect/rank max':>14} "
        f"{'calls':>6} {'steps run':>9} {'P2P MiB':>8} {'vs causal':>9} {'vs ring W':>9} "
        f"{'halo MiB':>9}"
    )
    print(hdr)
    causal_pairs, causal_p2p = {}, {}
    for w in (S, S // 4, S // 16):
        window = None if w >= S else (w - 1, None)
        for c in valid_team_sizes(P):
            lay = StarTrailLayout(P, c)
            per_rank = work(lay, s_local, window)
            p2p = p2p_mib(lay, shape, window)
            if window is None:
                causal_pairs[c] = max(x[0] for x in per_rank)
                causal_p2p[c] = p2p
            ring = p2p_mib(StarTrailLayout(P, 1), shape, window)  # ring, the same window
            # contiguous shards: each rank receives the W - 1 keys before its shard (K,V in
            # bf16), and sends their dK, dV (fp32) back; none at W = S (ring's bytes then)
            halo_tokens = min(w - 1, S - s_local) if window is not None else None
            halo = halo_tokens * kv_token * (2 + 4) / 2**20 if halo_tokens is not None else None
            pairs = max(x[0] for x in per_rank)
            mean = sum(x[0] for x in per_rank) / P
            vs = pairs / causal_pairs[c] if c in causal_pairs else float("nan")
            print(
                f"{w:>6} {c:>2} {pairs:>15.4g} {pairs / mean:>8.3f} {vs:>9.3f} "
                f"{max(x[1] for x in per_rank):>14.4g} "
                f"{max(x[2] for x in per_rank):>6} {steps_run(lay, s_local, window):>9} "
                f"{p2p:>8.1f} {p2p / causal_p2p[c]:>9.3f} {p2p / ring:>9.3f} "
                f"{f'{halo:.1f}' if halo is not None else '-':>9}"
            )


if __name__ == "__main__":
    main()
