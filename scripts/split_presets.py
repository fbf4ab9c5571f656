"""Where the 2-D split (Ulysses inside, StarTrail across) wins, on the planner's presets.

    python scripts/split_presets.py [--markdown]

Pure arithmetic (the cost model, no kernels run). For each preset cluster (``h100-ib``,
``a100-eth``; 8 GPUs per node, as many nodes as the CP size needs), model (``gpt-7b``,
``dit-1b``), sequence (64K - 1M tokens) and CP size (32 - 256 GPUs, one CP group over
them all): the fastest StarTrail without the split (C, placement, what the paper ran), the
fastest split (U, C, placement), Ulysses alone (where the heads allow it) and ring, each
as predicted per-layer time (forward + backward with recompute), and which is fastest.
The table in docs/performance.md ("StarTrail x Ulysses") is this script's output.
"""

from __future__ import annotations

import argparse

from startrail_megatron.planner import CLUSTER_PRESETS, MODEL_PRESETS, plan

SEQS = [64 * 1024, 256 * 1024, 1024 * 1024]
CPS = [32, 64, 256]


def rows():
    for cname in ("h100-ib", "a100-eth"):
        for mname in ("gpt-7b", "dit-1b"):
            for cp in CPS:
                cl = CLUSTER_PRESETS[cname]
                cl = cl.with_(num_nodes=max(cl.num_nodes, cp // cl.gpus_per_node))
                for seq in SEQS:
                    if seq % (2 * cp):
                        continue
                    pl = plan(cl, MODEL_PRESETS[mname], seq, cp)
                    fits = [r for r in pl.rows if r.fits]
                    plain = [r for r in fits if r.strategy.startswith("startrail")]
                    plain = [r for r in plain if r.ulysses_size == 1]
                    split = [r for r in fits if r.ulysses_size > 1]
                    by = {r.strategy: r for r in fits}
                    best = {
                        "ring": by.get("ring"),
                        "startrail": min(plain, key=lambda r: r.layer_s, default=None),
                        "split": min(split, key=lambda r: r.layer_s, default=None),
                        "ulysses": by.get("ulysses"),
                    }
                    fastest = min(fits, key=lambda r: r.layer_s, default=None)
                    yield cname, mname, cp, seq, best, fastest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true")
    p.parse_args()
    head = ["cluster", "model", "GPUs", "tokens", "ring ms", "best StarTrail", "ms",
            "best split", "ms", "Ulysses ms", "fastest"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for cname, mname, cp, seq, best, fastest in rows():

        def ms(r):
            return "-" if r is None else f"{r.layer_s * 1e3:.0f}"

        def name(r):
            return "-" if r is None else r.strategy

        cells = [
            cname, mname, str(cp), f"{seq // 1024}K", ms(best["ring"]),
            name(best["startrail"]), ms(best["startrail"]), name(best["split"]),
            ms(best["split"]), ms(best["ulysses"]), name(fastest),
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
