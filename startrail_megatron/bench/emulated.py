"""``startrail-bench --emulate NODESxRANKS --inter-node RATE``: the benchmark on an emulated
multi-node cluster (``emulate/``'s Note [the emulated cluster]).

The parent (root) builds the cluster, runs the link probe in it (``emulate.probe``: one
inside-node and one between-node exchange, and a ring step of every rank at once, timed), then the benchmark's ranks inside their
nodes (each is ``startrail-bench`` under torchrun's variables: every strategy side by side
in one run, as without emulation), and removes the cluster, also on failure. The report
gains ``emulation``: the topology and rates, the probe's times and rates, and per strategy
the cost model's prediction for the emulated cluster (the run's own kernel and buffer
calibration; links: ranks per node, the node's shared link in each direction at the
probe's rate, the inside-node rate it measured; the host's cores shared by every rank's
kernels and every transfer's host work, per byte as the probe measured it).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

from ..emulate import EmulatedCluster, EmulationSpec
from ..emulate.cluster import probe_all_to_all_elements
from ..planner.calibrate import fit_cluster
from ..planner.cluster import ClusterSpec
from ..planner.prediction import predict
from ..planner.shape import AttnShape
from ..planner.strategies import Strategy, candidate_strategies
from .timed_kernel import timed_cluster

__all__ = [
    "EMULATION_FLAGS",
    "NOMINAL_HOST_FLOPS",
    "QUIET_HOST_CORES",
    "emulated_cluster_spec",
    "emulation_rows",
    "host_cpu_warning",
    "merge_probes",
    "model_pick",
    "rank_argv",
    "run_emulated",
]

QUIET_HOST_CORES = 0.25
"""Background busy cores (beside the probe's own work) above which its host CPU reading
is not trusted (``host_cpu_warning``)."""

EMULATION_FLAGS = ("--emulate", "--inter-node", "--intra-node")
"""The parent's flags, taken out of the ranks' command line."""


def rank_argv(argv: list[str], out_json: str) -> list[str]:
    """The benchmark's command line for the ranks: the emulation flags and the outputs
    removed, the report written to ``out_json``."""
    drop = set(EMULATION_FLAGS) | {"--json", "--png", "--nproc"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a
            continue
        out.append(a)
    return [*out, "--json", out_json, "--png", ""]


NOMINAL_HOST_FLOPS = 1.1e11
"""Attention FLOP/s of this host's 2 cores with every rank computing at once (the fitted
kernels of the emulated runs of docs/performance.md, section 13: 8 ranks at 1.4e10 each):
the compute of the cluster the ranks' ``--auto-placement`` map search prices before the
run's own microbenchmarks exist. The maps differ in their transfers, not their kernels,
so this rate moves the search's pick little."""


def emulated_cluster_spec(
    spec: EmulationSpec,
    probe: dict,
    micro: dict | None,
    memory_bytes: float,
    backend: str = "gloo",
) -> ClusterSpec:
    """The cost model's cluster for the emulation: compute and buffers fitted on the run's
    own microbenchmarks (``fit_cluster``), links from the probe's transfers (between nodes:
    per node and direction, one rank alone reaching all of it, the node's ranks sharing it,
    at the lone pair's rate; the set rate where the probe had no second node; an
    all-to-all's off-node parts at the rate of the probe's all-to-all over every rank
    where below that: each rank's flow to every other node at once; inside a node: its
    rate; latencies: the probe's small-message floor is not measured, 0), and the host:
    its cores, shared by every rank's kernels and every transfer's packets, and the host
    CPU per byte moved inside a node and between nodes, from the pairs' exchanges
    (``ClusterSpec.host_cores``). A probe without host CPU (an older report) gives no host
    term, and the ring step's rate (every rank at once, the host busy with all their
    packets) where it is below the pair's. ``micro`` None: nominal kernels
    (``NOMINAL_HOST_FLOPS``), for the map search before the run."""
    if micro is None:
        w = spec.world_size
        base = ClusterSpec(
            name="nominal CPU ranks", gpus_per_node=w, num_nodes=1, intra_bw=1e9,
            intra_latency=0.0, inter_bw=1e9, inter_bw_per_gpu=1e9, inter_latency=0.0,
            attn_flops=NOMINAL_HOST_FLOPS / w, attn_bwd_ratio=2.5,
            matmul_flops=NOMINAL_HOST_FLOPS / w, kernel_overhead=1e-4,
            gpu_memory=memory_bytes, overlap=False,
            reduce_scatter_via_allreduce=backend == "gloo",
        )  # fmt: skip
    else:
        base = fit_cluster(
            micro, num_ranks=spec.world_size, memory_bytes=memory_bytes, backend=backend
        )
    nbytes, secs = probe["bytes"], probe["seconds"]
    inter = nbytes / secs["inter_node"] if "inter_node" in secs else spec.inter_bps / 8
    cpu = probe.get("host_cpu", {})
    per_byte = {  # the pairs' exchanges, each moving its bytes both ways
        k: v / (2 * nbytes)
        for k, v in cpu.get("per_call_s", {}).items()
        if k in ("intra_node", "inter_node")
    }
    if "ring_step" in secs and not per_byte:  # without the host's work modelled apart
        inter = min(inter, nbytes / secs["ring_step"])
    intra = nbytes / secs["intra_node"] if "intra_node" in secs else base.intra_bw
    a2a = 0.0
    if "all_to_all" in secs:
        # the node rate at which links.all_to_all's off-node part of the probe's
        # all-to-all takes its time: each rank's bytes in equal parts over the world
        world, local = spec.world_size, spec.ranks_per_node
        off = probe_all_to_all_elements(nbytes, world) * 4 * (world - local) / world
        a2a = min(inter, local * off / secs["all_to_all"])
    return base.with_(
        name=f"emulated {spec.nodes}x{spec.ranks_per_node} at {spec.inter_bps / 1e6:g} Mbit/s",
        host_cores=cpu.get("cores", 0) if per_byte else 0,
        host_cpu_intra=per_byte.get("intra_node", 0.0),
        host_cpu_inter=per_byte.get("inter_node", 0.0),
        gpus_per_node=spec.ranks_per_node,
        num_nodes=spec.nodes,
        intra_bw=intra,
        intra_latency=0.0,
        inter_bw=inter,
        inter_bw_per_gpu=inter,
        inter_latency=0.0,
        all_to_all_inter_bw=a2a,
        overlap=False,
    )


def _shape(config: dict) -> AttnShape:
    elem = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}[config["dtype"]]
    p = config["nproc"]
    return AttnShape(
        p, config["seq_len"] // p, config["batch"], config["heads"], config["kv_heads"],
        config["head_dim"], elem_bytes=elem, acc_bytes=8 if elem == 8 else 4,
        causal=config["causal"],
    )  # fmt: skip


def merge_probes(probes: list[dict]) -> dict:
    """One probe from several of the same cluster: each transfer's median over every
    repeat of them all (a typical rate over the run, as the strategies see it)."""
    pooled: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for pr in probes:
        for k, v in pr.get("repeats", {k: [v] for k, v in pr["seconds"].items()}).items():
            pooled.setdefault(k, []).extend(v)
        for k, v in pr.get("host_cpu", {}).get("per_call_s", {}).items():
            cpu.setdefault(k, []).append(v)
    merged = {
        **probes[0],
        "seconds": {k: statistics.median(v) for k, v in pooled.items()},
        "repeats": pooled,
    }
    if cpu:  # each transfer's host CPU: the mean of the probes'; the busier background
        with_cpu = [pr["host_cpu"] for pr in probes if "host_cpu" in pr]
        merged["host_cpu"] = {
            **with_cpu[0],
            "per_call_s": {k: statistics.fmean(v) for k, v in cpu.items()},
            "background_per_s": max(c.get("background_per_s", 0.0) for c in with_cpu),
        }
    return merged


def host_cpu_warning(probe: dict) -> str:
    """A warning where other work kept the host busy beside the probe (its host CPU per
    byte is read host-wide, ``/proc/stat``, so it is only right on an otherwise quiet
    host), else ""."""
    bg = probe.get("host_cpu", {}).get("background_per_s", 0.0)
    if bg < QUIET_HOST_CORES:
        return ""
    return (
        f"warning: host busy beside the probe ({bg:.2f} cores of other work): the host CPU "
        "per byte it measured, and the model's host term, are unreliable; run with nothing "
        "else on the host"
    )


def run_emulated(spec: EmulationSpec, argv: list[str], timeout: float) -> dict:
    """Build the cluster, probe its links, run the benchmark's ranks in it, probe again,
    remove it; the rank 0 report with ``emulation`` added (the links from both probes:
    ``merge_probes``)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe_json = [os.path.join(tmp, f"probe{i}.json") for i in (0, 1)]
        bench_json = os.path.join(tmp, "bench.json")
        py = [sys.executable, "-m"]
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        with EmulatedCluster(spec) as cl:
            cl.run([*py, "startrail_megatron.emulate.probe", probe_json[0]], timeout=timeout)
            ranks_argv = rank_argv(argv, bench_json)
            if "--auto-placement" in argv:  # the map search prices the probed links
                with open(probe_json[0]) as f:
                    first = json.load(f)
                links = os.path.join(tmp, "placement_cluster.json")
                with open(links, "w") as f:
                    json.dump(emulated_cluster_spec(spec, first, None, mem).__dict__, f)
                ranks_argv += ["--placement-cluster-json", links]
            bench = [*py, "startrail_megatron.bench", *ranks_argv]
            cl.run(bench, timeout, port=29556)  # a rendezvous port of its own each
            cl.run([*py, "startrail_megatron.emulate.probe", probe_json[1]], timeout, port=29557)
        runs = []
        for path in probe_json:
            with open(path) as f:
                runs.append(json.load(f))
        probe = {**merge_probes(runs), "runs": [r["seconds"] for r in runs]}
        with open(bench_json) as f:
            report = json.load(f)
    cfg = report["config"]
    cluster = emulated_cluster_spec(spec, probe, report["calibration"]["microbenchmarks"], mem)
    cluster_med = emulated_cluster_spec(
        spec, probe, report["calibration"]["microbenchmarks_median"], mem
    )
    rate = cfg.get("timed_kernels_flops")  # timed kernels waited the model's term at it
    cluster, cluster_med = timed_cluster(cluster, rate), timed_cluster(cluster_med, rate)
    rows = emulation_rows(report, cluster_med, cluster)
    secs = probe["seconds"]
    report["emulation"] = {
        **spec.as_dict(),
        "probe": {
            **probe,
            "rates_bits_per_s": {k: 8 * probe["bytes"] / v for k, v in secs.items()},
        },
        "cluster_median": cluster_med.__dict__,
        "rows": rows,
        "median_prediction_error": statistics.median(
            abs(r["predicted_over_median"] - 1) for r in rows
        ),
        "pick": model_pick(rows),
    }
    return report


def emulation_rows(report: dict, cluster_med: ClusterSpec, cluster: ClusterSpec | None = None):
    """Per strategy of a report: its median, the model's prediction on ``cluster_med`` (the
    emulated cluster calibrated on the run's median microbenchmarks; on ``cluster``, their
    fastest rounds', where given), MB sent inside and off the node, its median over
    ring's."""
    cfg = report["config"]
    shape = _shape(cfg)
    by_name = {s.name: s for s in candidate_strategies(cfg["nproc"], cfg["heads"], cfg["kv_heads"])}
    rows = []
    for r in report["results"]:
        if r.get("placement_map"):  # --auto-placement: the map the ranks computed and ran
            st = Strategy("startrail", r["team_size"], tuple(r["placement_map"]))
        else:
            st = by_name[r["strategy"]]
        pred = predict(st, cluster_med, shape).attn_s
        links = r["bytes_by_link_max_over_ranks"]
        row = {
            "strategy": r["strategy"],
            "median_s": r["median_s"],
            "predicted_median_s": pred,
            "predicted_over_median": pred / r["median_s"],
            "intra_node_bytes_max": links["intra_node"],
            "inter_node_bytes_max": links["inter_node"],
        }
        if cluster is not None:
            row["predicted_min_s"] = predict(st, cluster, shape).attn_s
        rows.append(row)
    ring = next((r["median_s"] for r in report["results"] if r["strategy"] == "ring"), None)
    for row in rows:
        row["median_over_ring"] = row["median_s"] / ring if ring else None
    return rows


def model_pick(rows: list[dict]) -> dict:
    """The strategy the model predicts fastest among those measured, against the measured
    fastest: the goal is the pick's median within 5% of the fastest's."""
    pick = min(rows, key=lambda r: r["predicted_median_s"])
    best = min(rows, key=lambda r: r["median_s"])
    ratio = pick["median_s"] / best["median_s"]
    return {
        "predicted_fastest": pick["strategy"],
        "measured_fastest": best["strategy"],
        "pick_over_fastest": ratio,
        "within_5_percent": ratio <= 1.05,
        "within_20_percent": sum(abs(r["predicted_over_median"] - 1) <= 0.2 for r in rows),
        "strategies": len(rows),
    }


def _host_cpu_text(cluster: dict) -> str:
    """The model's host work per byte moved, where the probe measured it."""
    if not cluster.get("host_cores"):
        return ""
    return (
        f"; host CPU per byte moved: {cluster['host_cpu_intra'] * 1e9:.2f} ns inside a node, "
        f"{cluster['host_cpu_inter'] * 1e9:.2f} ns between nodes, "
        f"on {cluster['host_cores']:g} cores"
    )


def format_emulation(report: dict) -> str:
    """The emulation's lines of the table: link rates and, per strategy, the measured
    median against ring's and the model's prediction for the emulated cluster."""
    em = report["emulation"]
    rates = em["probe"]["rates_bits_per_s"]
    lines = [
        f"emulated {em['nodes']} nodes x {em['ranks_per_node']} ranks, inter-node "
        f"{em['inter_node_bits_per_s'] / 1e6:g} Mbit/s each way per node"
        + (f", intra-node {em['intra_node_bits_per_s'] / 1e6:g} Mbit/s" if em["intra_node_bits_per_s"] else "")
        + "; probe: "
        + ", ".join(f"{k} {v / 1e6:.0f} Mbit/s" for k, v in rates.items())
        + _host_cpu_text(em.get("cluster_median", {})),
        f"{'strategy':28s}{'median ms':>10s}{'/ ring':>8s}{'model ms':>10s}{'mod/med':>9s}"
        f"{'in-node MB':>11s}{'off-node MB':>12s}",
    ]  # fmt: skip
    for r in em["rows"]:
        lines.append(
            f"{r['strategy']:28s}{r['median_s'] * 1e3:10.1f}{r['median_over_ring'] or 0:8.2f}"
            f"{r['predicted_median_s'] * 1e3:10.1f}{r['predicted_over_median']:9.2f}"
            f"{r['intra_node_bytes_max'] / 1e6:11.1f}{r['inter_node_bytes_max'] / 1e6:12.1f}"
        )
    pk = em["pick"]
    warning = host_cpu_warning(em["probe"])
    if warning:
        lines.append(warning)
    lines.append(
        f"model's pick {pk['predicted_fastest']} ({pk['pick_over_fastest']:.2f} of the measured "
        f"fastest, {pk['measured_fastest']}); {pk['within_20_percent']} of {pk['strategies']} "
        "predictions within 20% of the median"
    )
    return "\n".join(lines)
