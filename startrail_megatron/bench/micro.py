"""Microbenchmarks the cost model is calibrated on: kernel calls, buffer work, P2P, all-gathers.

``micro_tasks`` builds them (as the schedules make them), ``micro_record`` turns
their timed rounds into the tables ``planner.calibrate.fit_cluster`` reads, and
``cache_bytes_per_core`` reads the cache size the model's K,V re-streaming term uses.
"""

from __future__ import annotations

import math
import os

import torch

from ..comm import P2PComm, TeamComm
from ..kernels import get_kernel, merge_partial

__all__ = ["cache_bytes_per_core", "micro_record", "micro_tasks"]


Task = tuple[str, dict, object]
"""(table, row, fn): time ``fn``, record it in ``table`` with the row's sizes."""


def micro_tasks(args, rank, world, device, dtype, kernel=None) -> list[Task]:
    """Kernel calls, buffer work, P2P exchanges and all-gathers to time: (table, row, fn);
    the calls on ``kernel`` (an ``AttentionKernel``; None: ``"auto"``'s), the one the
    strategies run."""
    s = args.seq_len // world
    tasks = _kernel_tasks(args, s, world, device, dtype, kernel)
    tasks += _buffer_tasks(args, s, world, device, dtype)
    if world > 1:
        tasks += _comm_tasks(args, s, rank, world, device, dtype)
    return tasks


def _kernel_tasks(args, s: int, world: int, device, dtype, kernel=None) -> list[Task]:
    kern = get_kernel("auto", dtype) if kernel is None else kernel
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    tasks: list[Task] = []
    # Kernel calls as the schedules make them: K and V are views of one stacked
    # [n, 2, b, hkv, d] buffer. Square calls of 4 sizes; the long-key calls of
    # all-gather-KV (s/2 query rows against up to (2P-1) s/2 keys), whose K,V may not
    # fit in the cache (the model's re-streaming term); causal diagonal calls.
    half = max(s // 2, 1)
    shapes = [(n, n) for n in sorted({max(s // 4, 1), half, s, 2 * s})]
    shapes += [(half, m * half) for m in sorted({world + 1, 2 * world - 1}) if m * half > 2 * s]
    for nq, nk in shapes:
        q = torch.randn(nq, b, h, d, device=device, dtype=dtype)
        kv = torch.randn(nk, 2, b, hkv, d, device=device, dtype=dtype)
        acc = torch.zeros(nq, b, h, d, device=device, dtype=torch.float32)
        lse0 = torch.full((b, h, nq), -math.inf, device=device)

        def fwd(q=q, kv=kv, acc=acc, lse0=lse0):  # a call and the merge after it
            o, lse = kern.forward(q, kv[:, 0], kv[:, 1], causal=False, scale=scale)
            merge_partial(acc, lse0.clone(), o, lse)
            return o, lse

        o, lse = fwd()

        def bwd(o=o, q=q, kv=kv, lse=lse):
            kern.backward(o, q, kv[:, 0], kv[:, 1], o, lse, causal=False, scale=scale)

        row = {"q": nq, "k": nk, "pairs": nq * nk, "flops": 4 * d * h * b * nq * nk}
        tasks += [("kernel_fwd", row, fwd), ("kernel_bwd", row, bwd)]
        if nq == nk and nq >= s // 2:  # causal diagonal calls, as the schedules make them

            def cfwd(q=q, kv=kv):
                return kern.forward(q, kv[:, 0], kv[:, 1], causal=True, scale=scale)

            co, clse = cfwd()

            def cbwd(o=co, q=q, kv=kv, lse=clse):
                kern.backward(o, q, kv[:, 0], kv[:, 1], o, lse, causal=True, scale=scale)

            cp = nq * (nq + 1) // 2
            crow = {"q": nq, "k": nq, "causal": True, "rows": nq, "pairs": cp}
            crow["flops"] = 4 * d * h * b * cp
            tasks += [("kernel_causal_fwd", crow, cfwd), ("kernel_causal_bwd", crow, cbwd)]
    return tasks


def _buffer_tasks(args, s: int, world: int, device, dtype) -> list[Task]:
    b, hkv, d = args.batch, args.kv_heads, args.head_dim
    tasks: list[Task] = []
    # Elementwise work on buffers (the cost model's ``mem_bw``), done as the schedules do
    # it: a fresh zero-filled [n, 2, b, hkv, d] dK/dV accumulator in the accumulation
    # dtype, the K and V halves accumulated through strided views, then the 2P chunks
    # reordered; n = one rank's tokens and the whole sequence (all-gather-KV's buffer).
    # Bytes moved: X (zeros) + 3X (accumulate: read, read, write) + 2X (reorder) = 6X.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    order = list(range(2 * world))[::-1]
    for n in sorted({s, world * s}):
        g = torch.randn(n, b, hkv, d, device=device, dtype=acc)

        def buf(g=g):
            z = torch.zeros(g.shape[0], 2, *g.shape[1:], device=g.device, dtype=g.dtype)
            z[:, 0] += g
            z[:, 1] += g
            chunks = z.tensor_split(len(order))  # exactly 2P, as the schedules cut it
            return torch.cat([chunks[i] for i in order])

        tasks.append(("buffer", {"bytes": 6 * 2 * g.numel() * g.element_size()}, buf))
    return tasks


def _comm_tasks(args, s: int, rank: int, world: int, device, dtype) -> list[Task]:
    b, hkv, d = args.batch, args.kv_heads, args.head_dim
    tasks: list[Task] = []
    p2p = P2PComm(None, rank, None)
    team = TeamComm(None, world, None)
    kv_msg = 2 * s * b * hkv * d
    for numel in (256, kv_msg, 4 * kv_msg):
        x = torch.randn(numel, device=device, dtype=dtype)
        nb = x.numel() * x.element_size()

        def ex(x=x):
            p2p.exchange(x, (rank + 1) % world, (rank - 1) % world, "x").wait()

        def ag(x=x):
            team.all_gather(x, "x")

        tasks.append(("p2p", {"bytes": nb}, ex))
        tasks.append(("all_gather", {"bytes": (world - 1) * nb, "ranks": world}, ag))
    return tasks


def micro_record(tasks, times: list[list[float]], stat=min) -> dict:
    """``stat`` (the fastest, or the median) of every microbenchmark's rounds, as
    ``planner.calibrate`` reads it."""
    kernel: dict[tuple[str, int, int], dict] = {}
    out: dict[str, list] = {
        "kernel": [],
        "kernel_causal": [],
        "buffer": [],
        "p2p": [],
        "all_gather": [],
    }
    for (table, row, _), ts in zip(tasks, times):
        if table.startswith("kernel"):
            name, _, phase = table.rpartition("_")
            k = kernel.setdefault((name, row["q"], row["k"]), dict(row))
            k[f"{phase}_s"] = stat(ts)
        else:
            out[table].append({**row, "s": stat(ts)})
    for key in sorted(kernel):
        out[key[0]].append(kernel[key])
    return out


def cache_bytes_per_core(
    device: torch.device, base: str = "/sys/devices/system/cpu/cpu0/cache"
) -> int:
    """The L2 cache of CPU 0 from sysfs (the kernel's K,V working-set limit in the model);
    0 off CPU or where sysfs does not say (the model's re-streaming term then stays off)."""
    if device.type != "cpu":
        return 0
    try:
        for idx in sorted(os.listdir(base)):
            with open(f"{base}/{idx}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{base}/{idx}/size") as f:
                size = f.read().strip()
            unit = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * unit
    except (OSError, ValueError):
        pass
    return 0
