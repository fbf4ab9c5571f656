"""Per-(q, k)-pair cost of the local attention kernel by call shape, one process, one thread.

Shows what the cost model's K,V re-streaming term (``planner.compute.kv_stream_bytes``)
describes: calls whose per-head K,V (forward) or K,V,dK,dV (backward) exceed the
per-core cache cost more per pair than square calls whose K,V fit. K and V are views
of one stacked ``[n, 2, b, h, d]`` buffer, as the schedules pass them. Prints the
fastest of ``--repeats`` runs per call, forward and backward, in ns per pair.

    PYTHONPATH=. python scripts/kernel_cost_by_shape.py
"""

from __future__ import annotations

import argparse
import time

import torch

from startrail_megatron.kernels import get_kernel

SHAPES = ((256, 256), (512, 512), (1024, 1024), (256, 1792), (256, 3584), (256, 3840))


def _fastest(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _ns_per_pair(kern, nq: int, nk: int, h: int, d: int, repeats: int) -> tuple[float, float]:
    """(forward, backward) ns per (q, k) pair of one full call of nq queries and nk keys."""
    scale = d**-0.5
    q = torch.randn(nq, 1, h, d)
    kv = torch.randn(nk, 2, 1, h, d)
    k, v = kv[:, 0], kv[:, 1]
    o, lse = kern.forward(q, k, v, causal=False, scale=scale)
    tf = _fastest(lambda: kern.forward(q, k, v, causal=False, scale=scale), repeats)
    tb = _fastest(lambda: kern.backward(o, q, k, v, o, lse, causal=False, scale=scale), repeats)
    return tf / (nq * nk) * 1e9, tb / (nq * nk) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kern = get_kernel("auto", torch.float32)
    print(f"{'q':>6}{'k':>6}{'fwd ns/pair':>13}{'bwd ns/pair':>13}")
    for nq, nk in SHAPES:
        f, b = _ns_per_pair(kern, nq, nk, args.heads, args.head_dim, args.repeats)
        print(f"{nq:6d}{nk:6d}{f:13.1f}{b:13.1f}")


if __name__ == "__main__":
    main()
