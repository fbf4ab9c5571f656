"""The benchmark report's rows: one strategy's measured row (``strategy_row``) and the cost
model fitted to the run's microbenchmarks, its prediction added to every row
(``calibrate``)."""

from __future__ import annotations

import os
import statistics

import torch.distributed as dist

from ..planner.calibrate import fit_cluster
from ..planner.cluster import ClusterSpec
from ..planner.prediction import predict
from ..planner.shape import AttnShape
from ..planner.strategies import Strategy, comm_bytes
from .micro import cache_bytes_per_core
from .timed_kernel import timed_cluster

__all__ = ["calibrate", "strategy_row"]


def strategy_row(
    st: Strategy,
    err,
    peak,
    kept,
    led: dict,
    hidden: dict | None,
    links: list[dict],
    ts: list[float],
    shape: AttnShape,
) -> dict:
    """One strategy's row of the report: times, bytes (ledger and model), memory, error."""
    med = statistics.median(ts)
    q1, q3 = statistics.quantiles(ts, n=4, method="inclusive")[::2] if len(ts) > 1 else (med, med)
    return {
        "strategy": st.name,
        "kind": st.kind,
        "team_size": st.team_size,
        "placement": st.placement_label,
        "placement_map": list(st.placement) if isinstance(st.placement, tuple) else None,
        "median_s": med,
        "min_s": min(ts),
        "max_s": max(ts),
        "iqr_s": q3 - q1,
        "times_s": ts,
        "ledger_max_over_ranks": led,
        "bytes_by_link_per_rank": links,
        "bytes_by_link_max_over_ranks": {k: max(r[k] for r in links) for k in links[0]},
        "model_bytes_max_over_ranks": {
            k: max(b[k] for b in comm_bytes(st, shape)) for k in comm_bytes(st, shape)[0]
        },
        "peak_memory_bytes": peak,
        "kept_for_backward_bytes": kept,
        "kept_for_backward_a": kept / _a_bytes(shape),
        "paper_kept_a": _paper_kept_a(st),
        "max_rel_error": err,
        "overlap": hidden,
    }


def _a_bytes(shape: AttnShape) -> int:
    """A: one local q tensor, bytes (the paper's BNH/P)."""
    return shape.s_local * shape.batch * shape.heads_q * shape.head_dim * shape.elem_bytes


def _paper_kept_a(st: Strategy) -> float | None:
    """The paper's eqs. 8-10 for one layer's attention: ring 4 A, StarTrail (3C + 1) A;
    None for the peers (no formula)."""
    if st.kind != "startrail":
        return None
    return 4.0 if st.team_size == 1 else 3.0 * st.team_size + 1.0


def calibrate(
    strategies: list[Strategy],
    results: list[dict],
    micro: dict,
    micro_median: dict,
    shape: AttnShape,
    world: int,
    device,
    own_rows_first: bool | None = None,
    timed_flops: float | None = None,
) -> tuple[ClusterSpec, ClusterSpec]:
    """Fit the cost model to the microbenchmarks and add its prediction to every row
    (StarTrail's first step split as the run's ``--own-rows-first``; with ``timed_flops``,
    the kernels the timed kernels' rate, ``timed_kernel.timed_cluster``)."""
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fit = dict(
        num_ranks=world,
        memory_bytes=float(mem_total),
        backend=dist.get_backend(),
        cache_bytes=cache_bytes_per_core(device),
    )
    # Like for like: the model calibrated on each microbenchmark's fastest round predicts
    # the fastest round of each strategy; calibrated on their medians, the median.
    cluster = fit_cluster(micro, **fit).with_(own_rows_first=own_rows_first)
    cluster_median = fit_cluster(micro_median, **fit).with_(own_rows_first=own_rows_first)
    # Note [timed kernels]: timed kernels waited the model's term at ``timed_flops``
    cluster, cluster_median = (timed_cluster(c, timed_flops) for c in (cluster, cluster_median))
    for st, r in zip(strategies, results):
        pred = predict(st, cluster, shape).attn_s
        pred_med = predict(st, cluster_median, shape).attn_s
        r["predicted_s"] = pred
        r["predicted_over_measured"] = pred / r["min_s"]
        r["predicted_median_s"] = pred_med
        r["predicted_over_median"] = pred_med / r["median_s"]
    return cluster, cluster_median
