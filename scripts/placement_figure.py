"""The placement campaign's summary and chart (docs/performance.md section 15).

    python scripts/placement_figure.py --summary docs/placement_campaign.json REPORT.json ...
    python scripts/placement_figure.py --png docs/placement.png docs/placement_campaign.json

With ``--summary``: reads ``startrail-bench --emulate ... --auto-placement`` reports
(``scripts/placement_campaign.sh``) and writes their rows (per topology and strategy: the
median, its ratio to ring's, the model's prediction, MB sent off-node per rank, the map
that ran) to one small JSON. With ``--png``: draws, per topology, each strategy's median
over ring's from that JSON (the StarTrail C = 2 placements, the fastest 2-D split, Ulysses:
those the runs measured).
"""

from __future__ import annotations

import argparse
import json


def summarize(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        with open(path) as f:
            rep = json.load(f)
        em = rep["emulation"]
        maps = {r["strategy"]: r.get("placement_map") for r in rep["results"]}
        out.append({
            "topology": f"{em['nodes']}x{em['ranks_per_node']}",
            "inter_node_mbit": em["inter_node_bits_per_s"] / 1e6,
            "cp_size": rep["config"]["nproc"],
            "pick": em["pick"],
            "rows": [
                {
                    "strategy": r["strategy"],
                    "median_s": r["median_s"],
                    "median_over_ring": r["median_over_ring"],
                    "predicted_over_median": r["predicted_over_median"],
                    "inter_node_mb": r["inter_node_bytes_max"] / 1e6,
                    "placement_map": maps.get(r["strategy"]),
                }
                for r in em["rows"]
            ],
        })  # fmt: skip
    return out


def draw(summary: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [
        ("startrail-C2-team", "C = 2, team"),
        ("startrail-C2-ring", "C = 2, ring"),
        ("startrail-C2-map", "C = 2, computed map"),
        ("split", "best 2-D split"),
        ("ulysses", "Ulysses"),
    ]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.16
    nan = float("nan")
    bars = []
    for key, label in kinds:  # each kind some run measured (a run need not have them all)
        ys = []
        for run in summary:
            rows = {r["strategy"]: r["median_over_ring"] for r in run["rows"]}
            if key == "split":
                splits = [v for k, v in rows.items() if "+ulysses" in k]
                ys.append(min(splits) if splits else nan)
            else:
                ys.append(rows.get(key, nan))
        if any(y == y for y in ys):
            bars.append((label, ys))
    for i, (label, ys) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(summary))]
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="black", linewidth=1, label="ring")
    ax.axhline(0.85, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(summary)))
    ax.set_xticklabels(
        [f"{r['topology']} P={r['cp_size']}\n{r['inter_node_mbit']:g} Mbit/s" for r in summary]
    )
    ax.set_ylabel("median time / ring's")
    ax.set_title("Emulated nodes x ranks: each strategy's median time over ring's")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summary", help="write the summary JSON of the reports given")
    p.add_argument("--png", help="draw the chart from the summary JSON given")
    p.add_argument("inputs", nargs="+")
    args = p.parse_args(argv)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summarize(args.inputs), f, indent=1)
    if args.png:
        with open(args.inputs[0]) as f:
            draw(json.load(f), args.png)


if __name__ == "__main__":
    main()
