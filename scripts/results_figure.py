"""The README's results figure and table from ``startrail-bench --emulate`` reports.

    python scripts/results_figure.py REPORT.json [REPORT.json ...] --out docs/results.png

Each report is one emulated topology and link rate (``startrail-bench --emulate NODESxRANKS
--inter-node RATE --json REPORT.json``). Per report, the figure has one group of bars: each
strategy's median time over ring attention's (lower is better), StarTrail's best team size
and placement beside ring, the 2-D split (StarTrail x Ulysses) and the two peers
(all-gather, Ulysses), each bar labelled with the MB a rank sent off its node. The markdown
table printed on stdout has the same numbers, plus each rank's bytes in all (P2P and
collective, max over ranks, from the run's ledger) and the strategy of each group. Nothing
here is typed in: every number is read from the reports.
"""

from __future__ import annotations

import argparse
import json

GROUPS = (
    ("ring", "ring attention"),
    ("startrail", "StarTrail, best (C, placement)"),
    ("split", "2-D split (Ulysses x ring or StarTrail), best"),
    ("allgather", "all-gather (Megatron)"),
    ("ulysses", "Ulysses (DeepSpeed)"),
)
COLOURS = ("#7f7f7f", "#d62728", "#ff7f0e", "#1f77b4", "#2ca02c")


def _group(name: str) -> str | None:
    if name == "ring":
        return "ring"
    if name in ("allgather", "ulysses"):
        return name
    if "+ulysses" in name:
        return "split"
    if name.startswith("startrail-"):
        return "startrail"
    return None


def _total_bytes(row: dict) -> int:
    ledger = row["ledger_max_over_ranks"]
    return sum(v for k, v in ledger.items() if k.endswith("_bytes"))


def summarize(report: dict) -> dict:
    """The fastest strategy of each group of one report, with its ratio to ring and bytes."""
    em = report["emulation"]
    full = {r["strategy"]: r for r in report["results"]}
    best: dict[str, dict] = {}
    for row in em["rows"]:
        group = _group(row["strategy"])
        if group is None:
            continue
        if group not in best or row["median_over_ring"] < best[group]["median_over_ring"]:
            best[group] = row
    topology = f"{em['nodes']} x {em['ranks_per_node']}"
    rate = f"{em['inter_node_bits_per_s'] / 1e6:g} Mbit/s"
    return {
        "title": f"{topology}, P = {report['config']['nproc']}\n{rate} per node",
        "timed": bool(report["config"].get("timed_kernels_flops")),
        "label": f"{topology} (P = {report['config']['nproc']}), {rate}",
        "groups": {
            g: {
                "strategy": row["strategy"],
                "over_ring": row["median_over_ring"],
                "off_node_mb": row["inter_node_bytes_max"] / 1e6,
                "total_mb": _total_bytes(full[row["strategy"]]) / 1e6,
            }
            for g, row in best.items()
        },
    }


def markdown(summaries: list[dict]) -> list[str]:
    """A row per group of strategies, a column per report: time over ring's, then the MB
    each rank sent in all and off its node (max over ranks); below, which strategy was each
    group's fastest where the group has several."""
    out = [
        "| time / ring's; MB sent per rank (off-node) |"
        + "".join(f" {s['label']} |" for s in summaries),
        "| --- |" + " --- |" * len(summaries),
    ]
    for g, label in GROUPS:
        cells = []
        for s in summaries:
            row = s["groups"].get(g)
            cells.append(
                " - |"
                if row is None
                else f" {row['over_ring']:.2f}; {row['total_mb']:.0f} MB ({row['off_node_mb']:.0f}) |"
            )
        out.append(f"| {label} |" + "".join(cells))
    for g, label in GROUPS:
        if g in ("startrail", "split"):
            names = ", ".join(
                f"`{s['groups'][g]['strategy']}`" for s in summaries if g in s["groups"]
            )
            out.append(f"\n{label}: {names}.")
    return out


def draw(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 3.8), dpi=110)
    width = 0.16
    for j, (g, label) in enumerate(GROUPS):
        xs, ys, notes = [], [], []
        for i, s in enumerate(summaries):
            if g in s["groups"]:
                xs.append(i + (j - 2) * width)
                ys.append(s["groups"][g]["over_ring"])
                notes.append(f"{s['groups'][g]['off_node_mb']:.0f}")
        bars = ax.bar(xs, ys, width, label=label, color=COLOURS[j])
        for bar, note in zip(bars, notes):
            ax.annotate(
                note,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(summaries)), [s["title"] for s in summaries], fontsize=8)
    ax.set_ylabel("time / ring attention's")
    ranks = (
        "CPU ranks, kernels as timed waits" if all(s["timed"] for s in summaries) else "CPU ranks"
    )
    ax.set_title(
        f"Emulated cluster, forward + backward of one attention ({ranks}, tbf-limited links);"
        "\nlabels: MB each rank sent off its node",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncols=3, loc="upper left")
    ax.set_ylim(0, max(r["over_ring"] for s in summaries for r in s["groups"].values()) * 1.3)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="startrail-bench --emulate JSON reports")
    parser.add_argument("--out", default="results.png", help="the figure (PNG)")
    args = parser.parse_args(argv)
    summaries = []
    for path in args.reports:
        with open(path) as f:
            summaries.append(summarize(json.load(f)))
    draw(summaries, args.out)
    print("\n".join(markdown(summaries)))


if __name__ == "__main__":
    main()
