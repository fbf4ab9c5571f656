"""A benchmark's stand-in kernel: each call takes the time the cost model gives it, on no core.

Note [timed kernels]: on the emulated cluster (``emulate/``) every rank is a process of one
2-core host, so real kernels share two cores: the wall clock then follows the host's total
work (every rank's kernels together), not the slowest rank's path as on a cluster where each
rank has its own accelerator, and a schedule of many short steps (ring) pays the host's
scheduling on every step. ``TimedKernel`` keeps everything else real (the schedule, the
merges, the transfers on their links) and replaces only the kernel's arithmetic by a wait:
a call returns when ``call_s`` plus its work at ``attn_flops`` has passed since it began,
the work counted as the planner counts it (``planner.compute.kernel_time``: 4 x head_dim x
q heads x batch FLOPs per (q, k) pair; a causal diagonal call ``sq (sq + 1) / 2`` pairs, no
masked tile waste; the backward ``bwd_ratio`` times the forward). Ranks then compute side by
side, as accelerators do, while their transfers and Python still share the host.

Its numbers are not attention: outputs and gradients are zeros, the log-sum-exp 0. A run
with it checks no error and says so. It is not a user's kernel (not in
``kernels.KERNEL_NAMES``): the benchmarks take it by a flag (``startrail-bench
--timed-kernels``, ``scripts/batch_measure.py --timed-kernels``).
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from ..kernels.contract import acc_dtype

__all__ = ["TimedKernel", "dense_wait", "ratio_matched_flops", "timed_cluster", "timed_rate"]


class TimedKernel:
    """The kernel contract (``kernels.contract``), each call a wait of its modelled time.

    Args:
        attn_flops: the rate a call's pairs are counted at (FLOP/s, > 0).
        bwd_ratio: the backward's time over the forward's (the planner's
            ``attn_bwd_ratio``).
        call_s: a fixed cost per forward call (the backward's is ``bwd_ratio`` times it,
            as the planner's ``kernel_overhead``).
    """

    name = "timed"
    supports_dropout = False
    supports_band = False
    supports_softcap = False

    def __init__(self, attn_flops: float, bwd_ratio: float = 2.5, call_s: float = 0.0):
        for what, v, low in (("attn_flops", attn_flops, 0), ("bwd_ratio", bwd_ratio, 0)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > low):
                raise ValueError(f"TimedKernel {what}={v!r}: a finite number > 0")
        if not (isinstance(call_s, (int, float)) and math.isfinite(call_s) and call_s >= 0):
            raise ValueError(f"TimedKernel call_s={call_s!r}: a finite number >= 0")
        self.attn_flops, self.bwd_ratio, self.call_s = float(attn_flops), float(bwd_ratio), call_s
        self.waited_s = 0.0  # the modelled time of every call so far (what the tests read)

    def seconds(self, sq: int, sk: int, batch: int, heads_q: int, head_dim: int, causal: bool):
        """The forward's modelled time of one call of ``sq`` queries on ``sk`` keys."""
        if causal and sq != sk:
            raise ValueError(f"a causal call has as many keys as queries; got {sq} and {sk}")
        pairs = sq * (sq + 1) // 2 if causal else sq * sk
        return self.call_s + 4 * head_dim * heads_q * batch * pairs / self.attn_flops

    def _wait(self, t0: float, seconds: float) -> None:
        self.waited_s += seconds
        _sleep_until(t0 + seconds)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float):
        t0 = time.perf_counter()
        sq, b, hq, d = q.shape
        out = torch.zeros_like(q)
        lse = torch.zeros(b, hq, sq, dtype=acc_dtype(q.dtype), device=q.device)
        self._wait(t0, self.seconds(sq, k.shape[0], b, hq, d, causal))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        t0 = time.perf_counter()
        sq, b, hq, d = q.shape
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        self._wait(t0, self.bwd_ratio * self.seconds(sq, k.shape[0], b, hq, d, causal))
        return grads


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def timed_cluster(cluster, attn_flops: float | None, bwd_ratio: float = 2.5, overlap=True):
    """The cost model's cluster whose kernel term is exactly what ``TimedKernel(attn_flops,
    bwd_ratio)`` waits: its rate and backward ratio, no masked tile waste, no K,V
    re-streaming, and transfers that overlap the kernels and each other (``overlap``: a
    rank waiting in a kernel leaves the cores to its transfers' threads, as a device
    leaves its links; with kernels computing on the shared cores they do not). A
    ``ClusterSpec``, ``cluster`` itself where ``attn_flops`` is None or 0 (a run whose
    kernels computed); the fixed cost per call stays the cluster's, which ``startrail-bench``
    fits on timed calls under the run's load (their own host work is real), and so does
    its host term (the transfers' host work still shares the cores: pricing it as
    overlapping the waits moved no StarTrail prediction of the 3 x 8 emulated campaign by
    more than 6% and ring's from 0.88 to 0.80 of the measured). ``overlap`` was chosen on
    the 3 x 8, 200 Mbit/s run of section 15's timed campaign (7 -> 10 of 11 predictions
    within 20%) and checked on its other five."""
    if not attn_flops:
        return cluster
    return cluster.with_(
        attn_flops=attn_flops, attn_bwd_ratio=bwd_ratio, causal_tile_waste=0.0,
        kv_stream_bw=0.0, kv_stream_bw_bwd=0.0, overlap=overlap,
    )  # fmt: skip


def ratio_matched_flops(like, node_link_bytes_s: float, ranks_per_node: int) -> float:
    """A rank's timed-kernel rate (FLOP/s) that gives an emulated node the ratio of ``like``
    (a ``ClusterSpec``, e.g. the ``h100-ib`` preset): its node's attention FLOP/s over the
    node's off-node bytes/s (``gpus_per_node x attn_flops / inter_bw``). The emulated node
    moves ``node_link_bytes_s`` off-node and holds ``ranks_per_node`` ranks, so each runs at
    ``ratio x node_link_bytes_s / ranks_per_node``. Kernel time and off-node time then
    weigh against each other as on ``like``: the host's own rate (its 2 cores shared by the
    ranks) sets that ratio by accident, not by any cluster's."""
    for what, v in (("node_link_bytes_s", node_link_bytes_s), ("ranks_per_node", ranks_per_node)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"ratio_matched_flops {what}={v!r}: a finite number > 0")
    ratio = like.gpus_per_node * like.attn_flops / like.inter_bw
    return ratio * node_link_bytes_s / ranks_per_node


def timed_rate(value: str, spec=None) -> float | None:
    """A ``--timed-kernels`` value (``startrail-bench``, ``scripts/batch_measure.py``) as a
    rank's rate in FLOP/s: a cluster preset's node ratio on the emulated node link of
    ``spec`` (an ``emulate.EmulationSpec``; ``ratio_matched_flops``; ``ValueError`` without
    one), or a number of GFLOP/s (a finite number >= 0: 0 is the caller's to give a
    meaning); None for anything else. The callers name the flag and their defaults."""
    from ..planner.cluster import CLUSTER_PRESETS

    if value in CLUSTER_PRESETS:
        if spec is None:
            raise ValueError("a preset's ratio needs --emulate (its node link)")
        return ratio_matched_flops(CLUSTER_PRESETS[value], spec.inter_bps / 8, spec.ranks_per_node)
    try:
        v = float(value)
    except ValueError:
        return None
    return v * 1e9 if math.isfinite(v) and v >= 0 else None


def dense_wait(flops_per_token: float, matmul_flops: float):
    """A layer's GEMMs as a wait (Note [timed kernels]): a callable of a rank's token count
    that returns after ``tokens x flops_per_token / matmul_flops`` seconds (the forward and
    backward's FLOPs together in ``flops_per_token``)."""
    if not (math.isfinite(matmul_flops) and matmul_flops > 0 and flops_per_token >= 0):
        raise ValueError(
            f"dense_wait: flops_per_token={flops_per_token!r} >= 0 and "
            f"matmul_flops={matmul_flops!r} > 0"
        )

    def run(tokens: int) -> None:
        _sleep_until(time.perf_counter() + tokens * flops_per_token / matmul_flops)

    return run
