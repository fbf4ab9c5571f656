"""The emulated cluster's tables of docs/performance.md from ``startrail-bench --emulate`` reports.

    python scripts/emulated_table.py [--wide] [--repredict] REPORT.json [REPORT.json ...]

Each report is one topology and rate (``startrail-bench --emulate NODESxRANKS --inter-node
RATE --json REPORT.json``). Prints, per report (``--wide``: one table, a column group per
report, for reports of the same strategies), one markdown table (strategy: measured
median, its ratio to ring's, the cost model's prediction for the emulated cluster over
the median, MB sent inside the node and off it, max over ranks), then a summary table:
per report, the probe's rates, how many predictions are within 20% of the median, and
the model's pick against the measured fastest, over all strategies and over the StarTrail
family alone (ring and StarTrail, with or without the 2-D split).

``--repredict``: each prediction made again by the current cost model from the report's
own calibration (``emulation.cluster_median``: the probe's links and the run's median
microbenchmarks; with timed kernels ``timed_cluster`` of it), for reports made before a
change to the model.

``--ratio-of PRESET`` (a what-if of the model alone): per report, each strategy's
prediction over ring's at the run's own kernel rate and with timed kernels at the rate that
gives a node of the emulation the preset's ratio of attention FLOP/s to off-node bytes/s
(``bench.timed_kernel.ratio_matched_flops``; ``h100-ib``: 8 x 300 TFLOP/s per 360 GB/s).
Where a strategy loses to ring by moving more bytes off-node, a cluster of faster kernels
makes it lose more; where it loses on unhidden collectives, less.
"""

from __future__ import annotations

import argparse
import json

from startrail_megatron.bench.emulated import emulation_rows, model_pick
from startrail_megatron.bench.timed_kernel import timed_cluster
from startrail_megatron.planner.cli import load_cluster


def _title(rep: dict) -> str:
    em = rep["emulation"]
    return f"{em['nodes']} x {em['ranks_per_node']}, {em['inter_node_bits_per_s'] / 1e6:g} Mbit/s"


def strategy_table(rep: dict) -> list[str]:
    out = [
        f"{_title(rep)} (P = {rep['config']['nproc']}, {rep['config']['heads']} heads)",
        "",
        "| strategy | median ms | / ring | model / median | in-node MB | off-node MB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rep["emulation"]["rows"]:
        out.append(
            f"| {r['strategy']} | {r['median_s'] * 1e3:.0f} | {r['median_over_ring']:.2f} | "
            f"{r['predicted_over_median']:.2f} | {r['intra_node_bytes_max'] / 1e6:.1f} | "
            f"{r['inter_node_bytes_max'] / 1e6:.1f} |"
        )
    return out


def wide_table(reports: list[dict]) -> list[str]:
    """Strategies as rows; per report: median / ring's, model / median, off-node MB."""
    head = "| strategy |" + "".join(
        f" {_title(r)}: / ring | model / median | off-node MB |" for r in reports
    )
    out = [head, "| --- |" + " --- | --- | --- |" * len(reports)]
    names = [r["strategy"] for r in reports[0]["emulation"]["rows"]]
    for name in names:
        cells = []
        for rep in reports:
            row = next((r for r in rep["emulation"]["rows"] if r["strategy"] == name), None)
            if row is None:
                cells.append(" - | - | - |")
                continue
            cells.append(
                f" {row['median_over_ring']:.2f} | {row['predicted_over_median']:.2f} | "
                f"{row['inter_node_bytes_max'] / 1e6:.1f} |"
            )
        out.append(f"| {name} |" + "".join(cells))
    return out


def _family(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["strategy"] not in ("allgather", "ulysses")]


def summary_table(reports: list[dict]) -> list[str]:
    out = [
        "| topology | probe Mbit/s (off-node: pair, ring step) | within 20% |"
        " model's pick / measured fastest"
        " | StarTrail family: pick / fastest |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rep in reports:
        em = rep["emulation"]
        rates = em["probe"]["rates_bits_per_s"]
        every, fam = model_pick(em["rows"]), model_pick(_family(em["rows"]))
        probe = f"{rates.get('inter_node', 0) / 1e6:.0f}"
        if "ring_step" in rates:
            probe += f", {rates['ring_step'] / 1e6:.0f}"
        out.append(
            f"| {_title(rep)} | {probe} | "
            f"{every['within_20_percent']} of {every['strategies']} | "
            f"{every['predicted_fastest']} / {every['measured_fastest']}: "
            f"{every['pick_over_fastest']:.2f} | {fam['predicted_fastest']} / "
            f"{fam['measured_fastest']}: {fam['pick_over_fastest']:.2f} |"
        )
    return out


def ratio_table(rep: dict, path: str, preset: str) -> list[str]:
    """``--ratio-of``: predictions over ring's at the run's rate and at ``preset``'s ratio."""
    from startrail_megatron.bench.timed_kernel import ratio_matched_flops
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS

    em = rep["emulation"]
    base = load_cluster(path)
    run_rate = rep["config"].get("timed_kernels_flops")
    like = ratio_matched_flops(
        CLUSTER_PRESETS[preset], em["inter_node_bits_per_s"] / 8, em["ranks_per_node"]
    )
    cols = []
    for rate in (run_rate, like):
        rows = emulation_rows(rep, timed_cluster(base, rate))
        ring = next(r["predicted_median_s"] for r in rows if r["strategy"] == "ring")
        cols.append({r["strategy"]: r["predicted_median_s"] / ring for r in rows})
    at = "its kernels" if run_rate is None else f"{run_rate / 1e9:.3g} GFLOP/s"
    out = [
        f"{_title(rep)}: the model's time over ring's, at the run's rate ({at}) and at "
        f"{preset}'s ratio ({like / 1e9:.3g} GFLOP/s per rank)",
        "",
        "| strategy | model / ring, run's rate | model / ring, " + preset + "'s ratio |",
        "| --- | --- | --- |",
    ]
    for name in cols[0]:
        out.append(f"| {name} | {cols[0][name]:.2f} | {cols[1][name]:.2f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wide", action="store_true", help="one table, a column group per report")
    p.add_argument(
        "--repredict", action="store_true", help="predict again with the current cost model"
    )
    p.add_argument(
        "--ratio-of",
        default=None,
        metavar="PRESET",
        help="also the model's what-if at a cluster preset's ratio of kernel rate to link",
    )
    p.add_argument("reports", nargs="+")
    args = p.parse_args(argv)
    if args.ratio_of is not None:
        from startrail_megatron.planner.cluster import CLUSTER_PRESETS

        if args.ratio_of not in CLUSTER_PRESETS:
            p.error(f"--ratio-of {args.ratio_of!r}: one of {sorted(CLUSTER_PRESETS)}")
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    for path, rep in zip(args.reports, reports):
        if "emulation" not in rep:
            raise SystemExit(f"{path}: not an emulated report (no 'emulation')")
        if args.repredict:
            rate = rep["config"].get("timed_kernels_flops")
            rep["emulation"]["rows"] = emulation_rows(rep, timed_cluster(load_cluster(path), rate))
        if not args.wide:
            print("\n".join(strategy_table(rep)), end="\n\n")
        if args.ratio_of is not None:
            print("\n".join(ratio_table(rep, path, args.ratio_of)), end="\n\n")
    if args.wide:
        print("\n".join(wide_table(reports)), end="\n\n")
    print("\n".join(summary_table(reports)))


if __name__ == "__main__":
    main()
