"""The benchmark's outputs from its report: the table on stdout and the PNG chart."""

from __future__ import annotations

__all__ = ["format_table", "write_png"]


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"{c.get('workload', 'gpt')} workload, "
        f"P={c['nproc']} ranks ({report['environment']['backend']}, "
        f"{report['environment']['device']}), seq {c['seq_len']}, batch {c['batch']}, "
        f"{c['heads']} q / {c['kv_heads']} kv heads, head_dim {c['head_dim']}, {c['dtype']}, "
        f"{'causal' if c['causal'] else 'full'}; {c['repeats']} repeats after {c['warmup']} warm-up"
        f"; own rows first: {c.get('own_rows_first', 'auto')}"
        + (
            f"; kernels timed at {c['timed_kernels_flops'] / 1e9:.3g} GFLOP/s per rank, "
            "not computed (no error check)"
            if c.get("timed_kernels_flops")
            else ""
        ),
        f"{'strategy':28s}{'median ms':>10s}{'IQR ms':>8s}{'fwd P2P':>10s}{'fwd coll':>10s}"
        f"{'bwd P2P':>10s}{'bwd coll':>10s}{'calls':>7s}{'peak MiB':>9s}{'max err':>9s}"
        f"{'min ms':>9s}{'model ms':>9s}{'mod/min':>9s}{'model med':>10s}{'mod/med':>9s}"
        f"{'hidden %':>11s}{'kept A':>11s}",
    ]
    mib = 2**20
    for r in report["results"]:
        led = r["ledger_max_over_ranks"]
        calls = sum(v for k, v in led.items() if k.endswith("_calls"))
        err = "-" if r["max_rel_error"] is None else f"{r['max_rel_error']:.1e}"
        lines.append(
            f"{r['strategy']:28s}{r['median_s'] * 1e3:10.2f}{r['iqr_s'] * 1e3:8.2f}"
            f"{led['fwd_p2p_bytes'] / mib:10.2f}{led['fwd_collective_bytes'] / mib:10.2f}"
            f"{led['bwd_p2p_bytes'] / mib:10.2f}{led['bwd_collective_bytes'] / mib:10.2f}"
            f"{calls:7d}{r['peak_memory_bytes'] / mib:9.1f}{err:>9s}"
            f"{r['min_s'] * 1e3:9.2f}{r['predicted_s'] * 1e3:9.2f}{r['predicted_over_measured']:9.2f}"
            f"{r['predicted_median_s'] * 1e3:10.2f}{r['predicted_over_median']:9.2f}"
            f"{_hidden_range(r.get('overlap')):>11s}{_kept(r):>11s}"
        )
    lines.append(
        "bytes: MiB sent per rank (max over ranks, from the CommLedger); calls: P2P + collective, "
        f"fwd + bwd; peak: {report['memory_method']}; model: cost model calibrated on this run's "
        "microbenchmarks: fastest repeat of each vs the fastest repeat (min), median of each vs "
        "the median; hidden: the share of each rank's transfer time spent in flight while it "
        "computed, not blocked in a wait (min-max over ranks); kept A: what the forward keeps "
        "for the backward (autograd's saved storages, max over ranks) in units of A (one local "
        "q), / the paper's eqs. 8-10 (ring 4, StarTrail 3C+1)"
    )
    if c.get("comm_delay_ms") or c.get("comm_delay_ms_per_mib"):
        lines += _delay_table(report)
    return "\n".join(lines)


def _kept(r: dict) -> str:
    if r.get("kept_for_backward_a") is None:
        return "-"
    paper = r.get("paper_kept_a")
    return f"{r['kept_for_backward_a']:.2f}" + ("" if paper is None else f"/{paper:g}")


def _hidden_range(overlap: dict | None) -> str:
    if not overlap:
        return "-"
    vals = [h for h in overlap["hidden_per_rank"] if h is not None]
    if not vals:
        return "-"
    return f"{100 * min(vals):.0f}-{100 * max(vals):.0f}"


def _delay_table(report: dict) -> list[str]:
    d = report["config"]["comm_delay_ms"]
    per = report["config"].get("comm_delay_ms_per_mib", 0.0)
    slow = f"{d:g} ms" + (f" + {per:g} ms per MiB it moves" if per else "")
    lines = [
        "",
        f"every transfer slowed to at least {slow} (median ms over the same rounds):",
        f"{'strategy':28s}{'no delay':>10s}{'overlap':>10s}{'no overlap':>12s}{'hidden ms':>11s}"
        f"{'hidden %':>11s}{'exposed ms':>12s}",
    ]
    for r in report["results"]:
        dl = r.get("delay")
        if dl is None:
            continue
        ov, no = dl["overlap_median_s"], dl["no_overlap_median_s"]
        exp = dl["overlap"]["exposed_s_per_rank"] if dl["overlap"] else None
        lines.append(
            f"{r['strategy']:28s}{r['median_s'] * 1e3:10.1f}{ov * 1e3:10.1f}{no * 1e3:12.1f}"
            f"{(no - ov) * 1e3:11.1f}{_hidden_range(dl['overlap']):>11s}"
            f"{'-' if exp is None else f'{max(exp) * 1e3:.1f}':>12s}"
        )
    lines.append(
        "overlap: transfers waited on where needed (the shipped code); no overlap: each waited "
        "on as it starts; hidden ms: no overlap - overlap; hidden %: per rank, min-max, with the "
        "delay; exposed ms: the most any rank blocked in waits in one run with the delay"
    )
    return lines


def write_png(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = [r["strategy"] for r in res]
    x = range(len(res))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(res)), 4))
    med = [r["median_s"] * 1e3 for r in res]
    lo = [m - r["min_s"] * 1e3 for m, r in zip(med, res)]
    hi = [r["max_s"] * 1e3 - m for m, r in zip(med, res)]
    ax1.bar(x, med, yerr=[lo, hi], capsize=3, label="measured (median, min-max)")
    ax1.plot(x, [r["min_s"] * 1e3 for r in res], "k_", markersize=14, label="measured (min)")
    em = report.get("emulation")
    if em is not None:  # the model of the emulated cluster, not of one host
        pred = {r["strategy"]: r["predicted_median_s"] for r in em["rows"]}
        ax1.plot(x, [pred[n] * 1e3 for n in names], "rx", label="model of the emulated cluster")
    else:
        ax1.plot(x, [r["predicted_median_s"] * 1e3 for r in res], "rx", label="model (medians)")
    ax1.set_ylabel("forward + backward, ms")
    ax1.legend(fontsize=7)
    mib = 2**20
    p2p = [
        (r["ledger_max_over_ranks"]["fwd_p2p_bytes"] + r["ledger_max_over_ranks"]["bwd_p2p_bytes"])
        / mib
        for r in res
    ]
    col = [
        (
            r["ledger_max_over_ranks"]["fwd_collective_bytes"]
            + r["ledger_max_over_ranks"]["bwd_collective_bytes"]
        )
        / mib
        for r in res
    ]
    ax2.bar(x, p2p, label="P2P")
    ax2.bar(x, col, bottom=p2p, label="collective")
    ax2.set_ylabel("MiB sent per rank (fwd + bwd)")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    c = report["config"]
    where = report["environment"]["device"]
    if em is not None:
        where = (
            f"emulated {em['nodes']} nodes x {em['ranks_per_node']} ranks, "
            f"{em['inter_node_bits_per_s'] / 1e6:g} Mbit/s per node"
        )
    fig.suptitle(f"P={c['nproc']}, seq {c['seq_len']}, {c['dtype']}, {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
