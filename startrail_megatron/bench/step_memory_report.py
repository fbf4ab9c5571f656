"""The memory workload's outputs (``step_memory.py``): the table and the figure."""

from __future__ import annotations

__all__ = ["format_table", "write_png"]

from .memory import PHASES

MIB = 2**20


def format_table(report: dict) -> str:
    res = report["results"]
    plain = res.get("plain")
    lines = [
        f"{'config':>16} {'layers':>8} {'rest':>8} {'step':>8} {'planner':>8} {'vs plain':>9} "
        f"{'fixed':>7} {'resid':>6} {'longest seq':>12} {'x plain':>8} {'loss diff':>10}",
        f"{'':>16} {'KiB/token':^35} {'':>9} {'MiB':>7} {'MiB':>6}",
    ]
    for key, r in res.items():
        slope = r["slope_bytes_per_token"]
        ratio = plain["slope_bytes_per_token"] / slope if plain and slope > 0 else float("nan")
        gain = (
            r["longest_seq_len"] / plain["longest_seq_len"]
            if plain and plain["longest_seq_len"]
            else float("nan")
        )
        diff = r["loss_rel_diff_vs_plain"]
        ph = [
            f"{r[p]['slope_bytes_per_token'] / 1024:8.2f}" if p in r else f"{'-':>8}"
            for p in PHASES
        ]
        pl = r.get("planner_bytes_per_token")
        planned = f"{'-':>8}" if pl is None else f"{pl / 1024:8.2f}"
        lines.append(
            f"{key:>16} {ph[0]} {ph[1]} {slope / 1024:8.2f} {planned} {ratio:8.1f}x "
            f"{r['fixed_bytes'] / MIB:7.1f} {r['max_residual_bytes'] / MIB:6.1f} "
            f"{r['longest_seq_len']:12d} {gain:7.1f}x {'-' if diff is None else f'{diff:.1e}':>10}"
        )
    lines.append(
        f"(per rank; peak = {report['method']}; layers / rest: the phases' slopes, step: the "
        f"steeper; longest under {report['budget_bytes'] / MIB:.0f} MiB from the lines; local "
        "tokens = seq / CP)"
    )
    return "\n".join(lines)


def write_png(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, r in report["results"].items():
        pts = sorted(
            (x["local_tokens"], x["peak_bytes"] / MIB)
            for x in report["runs"]
            if x["config"] == r["config"] and x["vocab"] == r["vocab"]
        )
        xs = [x for x, _ in pts]
        (ln,) = ax.plot(
            xs,
            [y for _, y in pts],
            "o",
            label=f"{key} ({r['slope_bytes_per_token'] / 1024:.1f} KiB/token)",
        )
        fx = [0, max(xs)]
        ax.plot(
            fx,
            [(r["fixed_bytes"] + r["slope_bytes_per_token"] * x) / MIB for x in fx],
            "-",
            color=ln.get_color(),
            lw=0.8,
        )
    ax.axhline(report["budget_bytes"] / MIB, color="k", ls="--", lw=0.8, label="budget")
    ax.set_xlabel("local tokens per rank (sequence / CP)")
    ax.set_ylabel("peak memory per rank, MiB")
    m = report["model"]
    ax.set_title(
        f"whole training step, GPT {m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}, CP {m['cp']}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
