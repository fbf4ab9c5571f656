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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wide", action="store_true", help="one table, a column group per report")
    p.add_argument(
        "--repredict", action="store_true", help="predict again with the current cost model"
    )
    p.add_argument("reports", nargs="+")
    args = p.parse_args(argv)
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
    if args.wide:
        print("\n".join(wide_table(reports)), end="\n\n")
    print("\n".join(summary_table(reports)))


if __name__ == "__main__":
    main()
