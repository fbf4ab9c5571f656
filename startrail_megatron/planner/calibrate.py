"""Fit the cost model's constants from a benchmark's own microbenchmarks.

The benchmark (``startrail_megatron.bench``) times, on all ranks at once:
full (non-causal) kernel calls of a few sizes, forward and backward (each
forward followed by the merge every schedule does after it); P2P exchanges
with the ring neighbour of a few sizes; and all-gathers over all ranks.
Each point is the fastest of its repeats (the least disturbed by other load
on a shared host). Least squares on relative errors then gives:

  kernel:  t_fwd = overhead + flops / attn_flops      (flops = 4 d h b pairs)
           attn_bwd_ratio = median(t_bwd / t_fwd)
           causal_tile_waste = median over causal calls of the pairs their time
           buys beyond the unmasked ones, per query row (fwd + bwd)
  buffers: t = bytes / mem_bw (bytes read + written by a zero-fill, an accumulation
           and a chunk reorder of a K,V-sized and a full-sequence K,V-sized buffer;
           least squares on relative errors through the origin)
  links:   t = k * alpha + bytes / bw, k = 1 for a P2P, n-1 for an n-rank all-gather

The fitted ``ClusterSpec`` is one node holding every rank (all links
intra-node) and does not overlap communication with compute: gloo's
transfers need the same oversubscribed CPU cores the kernels run on.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .cluster import ClusterSpec

__all__ = ["fit_linear", "fit_cluster"]


def fit_linear(
    xs: Sequence[Sequence[float]], ys: Sequence[float], *, relative: bool = True
) -> list[float]:
    """Non-negative least squares for ``y = sum_i c_i x_i`` with two unknowns.

    ``relative``: minimize relative errors (each row divided by its ``y``), so
    small and large measurements count alike. Solves the 2x2 normal
    equations; a negative coefficient is clamped to 0 and the other refit
    alone (a latency cannot be negative).
    """
    if len(xs) != len(ys) or len(ys) < 2 or any(len(x) != 2 for x in xs):
        raise ValueError("fit_linear needs >= 2 points of 2 features each")
    if relative and all(y > 0 for y in ys):
        xs = [(x[0] / y, x[1] / y) for x, y in zip(xs, ys)]
        ys = [1.0] * len(ys)
    a11 = sum(x[0] * x[0] for x in xs)
    a12 = sum(x[0] * x[1] for x in xs)
    a22 = sum(x[1] * x[1] for x in xs)
    b1 = sum(x[0] * y for x, y in zip(xs, ys))
    b2 = sum(x[1] * y for x, y in zip(xs, ys))
    det = a11 * a22 - a12 * a12
    c = [(b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det] if det else [-1.0, -1.0]
    if c[0] >= 0 and c[1] >= 0:
        return c
    if c[0] < 0 and a22:
        return [0.0, max(b2 / a22, 0.0)]
    return [max(b1 / a11, 0.0) if a11 else 0.0, 0.0]


def fit_cluster(
    micro: dict, *, num_ranks: int, memory_bytes: float, backend: str = "gloo"
) -> ClusterSpec:
    """A ``ClusterSpec`` from the benchmark's ``calibration`` record.

    ``micro`` holds ``kernel``: rows {pairs, flops, fwd_s, bwd_s} of full calls;
    ``kernel_causal`` (optional): causal calls, {rows, pairs (unmasked), flops, fwd_s, bwd_s};
    ``buffer`` (optional): rows {bytes (read + written), s};
    ``p2p``: rows {bytes, s}; ``all_gather``: rows {bytes (per-rank volume), ranks, s}.
    ``backend``: the process group's; gloo runs a reduce-scatter as an all-reduce.
    """
    k = micro["kernel"]
    overhead, inv_tp = fit_linear([(1.0, r["flops"]) for r in k], [r["fwd_s"] for r in k])
    note = ""
    if inv_tp <= 0:  # timings did not grow with the work (tiny sizes, noise)
        big = max(k, key=lambda r: r["flops"])
        overhead, inv_tp = 0.0, big["fwd_s"] / big["flops"]
        note = "; kernel fit degenerate: throughput of the largest call, no overhead"
    bwd_ratio = statistics.median(r["bwd_s"] / r["fwd_s"] for r in k)
    # Causal (diagonal) calls: the work beyond their unmasked pairs, per query row.
    waste = []
    for r in micro.get("kernel_causal", []):
        t = (r["fwd_s"] + r["bwd_s"]) / (1 + bwd_ratio) - overhead
        per_pair = r["flops"] / r["pairs"]
        waste.append(max(t / inv_tp / per_pair - r["pairs"], 0.0) / r["rows"])
    tile_waste = statistics.median(waste) if waste else 0.0
    # Buffers: minimize sum (1 - c bytes/s)^2 over c = 1/mem_bw.
    ratios = [r["bytes"] / r["s"] for r in micro.get("buffer", []) if r["s"] > 0]
    mem_bw = sum(x * x for x in ratios) / sum(ratios) if ratios else 0.0
    rows = [((1.0, r["bytes"]), r["s"]) for r in micro["p2p"]]
    rows += [((r["ranks"] - 1.0, r["bytes"]), r["s"]) for r in micro["all_gather"]]
    if len(rows) >= 2:
        alpha, inv_bw = fit_linear([x for x, _ in rows], [y for _, y in rows])
    else:  # one rank: nothing to send
        alpha, inv_bw = 0.0, 0.0
    bw = 1.0 / inv_bw if inv_bw > 0 else 1e15
    return ClusterSpec(
        name=f"calibrated CPU ranks ({num_ranks} gloo ranks, one host){note}",
        gpus_per_node=num_ranks,
        num_nodes=1,
        intra_bw=bw,
        intra_latency=alpha,
        inter_bw=bw,
        inter_bw_per_gpu=bw,
        inter_latency=alpha,
        attn_flops=1.0 / inv_tp,
        attn_bwd_ratio=bwd_ratio,
        matmul_flops=1.0 / inv_tp,
        kernel_overhead=overhead,
        gpu_memory=memory_bytes,
        overlap=False,
        causal_tile_waste=tile_waste,
        mem_bw=mem_bw,
        reduce_scatter_via_allreduce=backend == "gloo",
    )
