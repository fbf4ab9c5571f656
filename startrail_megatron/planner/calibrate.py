"""Fit the cost model's constants from a benchmark's own microbenchmarks.

The benchmark (``startrail_megatron.bench``) times, on all ranks at once:
full (non-causal) kernel calls of a few sizes, forward and backward (each
forward followed by the merge every schedule does after it); P2P exchanges
with the ring neighbour of a few sizes; and all-gathers over all ranks.
Each point is the fastest of its repeats (the least disturbed by other load
on a shared host). Least squares on relative errors then gives:

  kernel:  t_fwd = overhead + flops / attn_flops      (flops = 4 d h b pairs)
           attn_bwd_ratio = median(t_bwd / t_fwd)
           (both from the calls whose per-head K,V fit in ``cache_bytes``), then
           kv_stream_bw, kv_stream_bw_bwd = the re-streamed bytes of the calls
           that do not fit (``compute.kv_stream_bytes``: the long-key calls of
           all-gather-KV, a long square call's backward) over the time they take
           beyond the fit above (least squares on relative errors, through the origin)
           causal_tile_waste = median over causal calls of the pairs their time
           buys beyond the unmasked ones (and their re-streaming), per query row
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
from .compute import kv_stream_bytes

__all__ = ["TORCH_CPU_FLASH_Q_BLOCKS", "fit_linear", "fit_cluster"]

TORCH_CPU_FLASH_Q_BLOCKS: tuple[tuple[int, int], ...] = ((768, 256), (192, 64), (0, 32))
"""Query block of PyTorch's CPU flash attention by query length (``flash_attention_kernel_impl``
in aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: 256 rows from 768 queries, 64 from
192, else 32; key blocks of 512)."""


def _through_origin(points: Sequence[tuple[float, float, float]]) -> float:
    """c minimizing sum(((y - c x) / t)^2) over (x, y, t); 0 when it is not positive."""
    num = sum(x * y / (t * t) for x, y, t in points)
    den = sum(x * x / (t * t) for x, _, t in points)
    return num / den if den and num > 0 else 0.0


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
    micro: dict,
    *,
    num_ranks: int,
    memory_bytes: float,
    backend: str = "gloo",
    cache_bytes: float = 0.0,
    q_blocks: tuple[tuple[int, int], ...] = TORCH_CPU_FLASH_Q_BLOCKS,
) -> ClusterSpec:
    """A ``ClusterSpec`` from the benchmark's ``calibration`` record.

    ``micro`` holds ``kernel``: rows {pairs, flops, fwd_s, bwd_s} of full calls (with
    {q, k}: their query and key lengths, needed for the re-streaming term);
    ``kernel_causal`` (optional): causal calls, {rows, pairs (unmasked), flops, fwd_s,
    bwd_s (, q, k)}; ``dims`` (optional): {batch, heads_q, head_dim, elem_bytes, grad_bytes}
    of the kernel calls; ``buffer`` (optional): rows {bytes (read + written), s};
    ``p2p``: rows {bytes, s}; ``all_gather``: rows {bytes (per-rank volume), ranks, s}.
    ``backend``: the process group's; gloo runs a reduce-scatter as an all-reduce.
    ``cache_bytes``: the per-core cache of the kernel's K,V working set (0: no
    re-streaming term, as on GPUs); ``q_blocks``: the kernel's query blocks.
    """
    dims = micro.get("dims")
    if not dims or not all("q" in r for r in micro["kernel"]):
        cache_bytes = 0.0

    def streamed(r: dict, bwd: bool) -> float:
        if not cache_bytes:
            return 0.0
        return kv_stream_bytes(
            r["q"], r["k"], r.get("causal", False), cache_bytes=cache_bytes,
            q_blocks=q_blocks, bwd=bwd, **dims,
        )  # fmt: skip

    k = micro["kernel"]
    note = ""
    # Compute constants from the calls whose K,V fit; with fewer than two of them the
    # re-streaming cannot be told apart from the compute: the term is switched off.
    fits = [r for r in k if not streamed(r, False)]
    if cache_bytes and len(fits) < 2:
        cache_bytes, fits = 0.0, k
        note = "; K,V re-streaming term off: fewer than 2 kernel calls fit the cache"
    base = fits
    overhead, inv_tp = fit_linear([(1.0, r["flops"]) for r in base], [r["fwd_s"] for r in base])
    if inv_tp <= 0:  # timings did not grow with the work (tiny sizes, noise)
        big = max(base, key=lambda r: r["flops"])
        overhead, inv_tp = 0.0, big["fwd_s"] / big["flops"]
        note += "; kernel fit degenerate: throughput of the largest call, no overhead"
    both = [r for r in base if not streamed(r, True)] or base
    bwd_ratio = statistics.median(r["bwd_s"] / r["fwd_s"] for r in both)
    # Re-streaming of the calls whose K,V do not fit: time beyond the compute fit.
    stream_bw = []
    for bwd, key, factor in ((False, "fwd_s", 1.0), (True, "bwd_s", bwd_ratio)):
        pts = [
            (x, r[key] - factor * (overhead + r["flops"] * inv_tp), r[key])
            for r in k
            if (x := streamed(r, bwd))
        ]
        c = _through_origin(pts)
        stream_bw.append(1.0 / c if c else 0.0)
        if pts and not c:
            note += f"; {'backward' if bwd else 'forward'} K,V re-streaming not measurable (off)"
    # Causal (diagonal) calls: the work beyond their unmasked pairs, per query row.
    waste = []
    for r in micro.get("kernel_causal", []):
        extra = sum(
            streamed(r, b) / bw for b, bw in zip((False, True), stream_bw) if bw and "q" in r
        )
        t = (r["fwd_s"] + r["bwd_s"] - extra) / (1 + bwd_ratio) - overhead
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
        kernel_cache_bytes=float(cache_bytes),
        kernel_q_blocks=tuple(tuple(x) for x in q_blocks) if cache_bytes else (),
        kv_stream_bw=stream_bw[0],
        kv_stream_bw_bwd=stream_bw[1],
    )
