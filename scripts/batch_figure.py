"""The per-batch layout measurements' chart and table (docs/performance.md section 17).

    python scripts/batch_figure.py --png docs/batch_layouts.png docs/batch_measure_cpu.json \
        docs/batch_measure_emulated_16k.json docs/batch_measure_emulated_64k.json \
        docs/batch_measure_emulated_2x8.json
    python scripts/batch_figure.py --png docs/batch_layouts_timed.png \
        docs/batch_measure_emulated_2x4_timed.json docs/batch_measure_emulated_2x8_timed.json

Reads ``scripts/batch_measure.py --json`` rows (one file, or several: CPU ranks and
emulated runs) and draws, per (lengths, ranks, machine), each layout's throughput against
static StarTrail's: measured (the slowest rank's thread CPU time; on an emulated cluster
also the wall clock) beside the model's. ``--table`` prints the Markdown table instead
(the layer's table for ``batch_measure.py --layer-ffn`` reports: ours, ours on the pairs
alone, Megatron's, and the tokens each rank held).
"""

from __future__ import annotations

import argparse
import json

LAYOUTS = ("static ring", "ours", "megatron")


def _load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)
    return rows


def _groups(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        where = f"emulated {r['emulated']} @ {r['inter_node']}" if r.get("emulated") else "CPU"
        if r.get("layer_ffn"):
            where += f", layer (MLP {r['layer_ffn']})"
        if r.get("timed_kernels"):  # Note [timed kernels]: the wall clock is the measure
            where += ", timed kernels"
            if r.get("timed_kernels_flops"):  # recorded since the rate can be set
                where += f" at {r['timed_kernels_flops'] / 1e9:.3g} GFLOP/s"
        key = (r["dist"], r["ranks"], r["batch_tokens"], where)
        out.setdefault(key, {})[r["layout"]] = r
    return out


def _name(layout: str) -> str:
    return "static StarTrail" if layout.startswith("static StarTrail") else layout


def _ratio(by: dict, base: dict, name: str, key: str) -> str:
    r = by.get(name)
    return f"{base[key] / r[key]:.2f}" if r else "refused"


def _cell(by: dict, name: str, key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    r = by.get(name)
    return fmt.format(r[key] / scale) if r else "-"


def table(rows: list[dict]) -> str:
    """Per (lengths, P, tokens, machine): each layout's throughput against static
    StarTrail's from the slowest rank's CPU time (and the wall clock after a slash, where
    it means something: emulated runs, P <= 4), the model's, balance and bytes sent."""
    lines = [
        "| lengths | P | tokens | machine | static ring | ours | Megatron's | model: ours, "
        "Megatron's | balance: ours, Megatron's | max MiB sent: static StarTrail, ours, "
        "Megatron's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    mib = float(2**20)
    for (dist, p, tokens, where), by in _groups(rows).items():
        base = next(v for k, v in by.items() if _name(k) == "static StarTrail")
        wall = where != "CPU" or p <= 4
        meas = {
            n: _ratio(by, base, n, "cpu_critical_s")
            + (f" / {_ratio(by, base, n, 'wall_s')}" if wall else "")
            for n in LAYOUTS
        }
        if "timed kernels" in where:  # the kernels use no CPU: the wall clock alone
            meas = {n: f"- / {_ratio(by, base, n, 'wall_s')}" for n in LAYOUTS}
        lines.append(
            f"| {dist} | {p} | {tokens // 1024}K | {where} | {meas['static ring']} | "
            f"{meas['ours']} | {meas['megatron']} | {_ratio(by, base, 'ours', 'model_s')}, "
            f"{_ratio(by, base, 'megatron', 'model_s')} | {_cell(by, 'ours', 'balance')}, "
            f"{_cell(by, 'megatron', 'balance')} | {base['max_bytes'] / mib:.0f}, "
            f"{_cell(by, 'ours', 'max_bytes', mib, '{:.0f}')}, "
            f"{_cell(by, 'megatron', 'max_bytes', mib, '{:.0f}')} |"
        )
    return "\n".join(lines)


def layer_table(rows: list[dict]) -> str:
    """``table`` for ``--layer-ffn`` reports: the layer's throughput against static
    StarTrail's (slowest rank's CPU time; with timed kernels the wall clock), measured and
    the model's, and tokens max / mean."""
    names = ("static ring", "ours", "ours, pairs only", "megatron")
    lines = [
        "| lengths | P | tokens | machine | static ring | ours | ours, pairs only | Megatron's "
        "| model: ours, pairs only, Megatron's | tokens max / mean: ours, pairs only, "
        "Megatron's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (dist, p, tokens, where), by in _groups(rows).items():
        base = next(v for k, v in by.items() if _name(k) == "static StarTrail")
        key = "wall_s" if "timed kernels" in where else "cpu_critical_s"
        meas = [_ratio(by, base, n, key) for n in names]
        model = ", ".join(_ratio(by, base, n, "model_s") for n in names[1:])
        toks = ", ".join(_cell(by, n, "token_balance") for n in names[1:])
        timed = ", timed kernels" + where.split(", timed kernels")[1] if key == "wall_s" else ""
        where = where.split(", layer")[0].split(", timed kernels")[0] + timed
        lines.append(
            f"| {dist} | {p} | {tokens // 1024}K | {where} | {' | '.join(meas)} | {model} | "
            f"{toks} |"
        )
    return "\n".join(lines)


def draw(rows: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 4.2))
    width = 0.13
    colors = {"static ring": "#999999", "ours": "#1f77b4", "megatron": "#d62728"}
    labels = []
    for i, ((dist, p, tokens, where), by) in enumerate(groups.items()):
        base = next(v for k, v in by.items() if _name(k) == "static StarTrail")
        labels.append(
            f"{dist}\nP={p}, {tokens // 1024}K\n"
            + where.replace(" @ ", "\n").replace(", ", "\n").replace(" at ", "\n")
        )
        for j, name in enumerate(LAYOUTS):
            r = by.get(name)
            if r is None:
                continue
            key = "wall_s" if where != "CPU" else "cpu_critical_s"
            off = (j - 1) * 2 * width
            ax.bar(i + off - width / 2, base[key] / r[key], width, color=colors[name],
                   label=f"{name}, measured" if i == 0 else None)  # fmt: skip
            ax.bar(i + off + width / 2, base["model_s"] / r["model_s"], width,
                   color=colors[name], alpha=0.35, hatch="//",
                   label=f"{name}, model" if i == 0 else None)  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("throughput / static StarTrail's")
    ax.set_title(
        "Per-batch layouts: measured (slowest rank's CPU time; emulated or timed kernels: wall "
        "clock) and model",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--png", default="")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args(argv)
    rows = _load(args.reports)
    if args.table or not args.png:
        print(layer_table(rows) if any(r.get("layer_ffn") for r in rows) else table(rows))
    if args.png:
        draw(rows, args.png)


if __name__ == "__main__":
    main()
