"""Side-by-side benchmark: StarTrail (every C, both placements), ring, all-gather-KV, Ulysses.

    startrail-bench --nproc 4 --seq-len 4096          # or scripts/bench_attention.py

One run, the same inputs, shapes and ranks for every strategy. For each it
times forward + backward (``--warmup`` untimed, then ``--repeats`` timed rounds;
a repeat's time is the slowest rank's; the rounds interleave all strategies and
the microbenchmarks, so load from elsewhere on a shared host falls on all alike), and records the bytes each rank sent
(P2P and collective, from the ``CommLedger``), the communication calls, the
peak memory, and the largest error against a float64 reference. It also
times a few kernel calls, elementwise buffer operations, P2P exchanges and
all-gathers, fits the cost
model's constants to them (``planner.calibrate``) and prints the calibrated
model's prediction beside each measured time.

Peak memory (``--memory``, largest over ranks): on CUDA
``torch.cuda.max_memory_allocated`` over one iteration; on CPU by default the
peak of live tensor bytes during one iteration, tracked at PyTorch's
dispatch level (``MemTracker``: tensors only, no allocator slack); ``--memory rss`` uses the
resident-set high-water growth instead (see ``PeakMemory``).

Outputs: a table on stdout, ``--json`` (all numbers), ``--png`` (time and
bytes per strategy). Runs on CPU with gloo (spawns ``--nproc`` ranks), or
under ``torchrun`` (NCCL on GPUs, one rank per GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import peers
from ..attention import startrail_attention
from ..comm import CommLedger, P2PComm, TeamComm
from ..groups import StarTrailGroups
from ..kernels import get_kernel, merge_partial
from ..planner.calibrate import fit_cluster
from ..planner.prediction import predict
from ..planner.shape import AttnShape
from ..planner.strategies import Strategy, candidate_strategies, comm_bytes
from ..spawn import spawn_local_ranks
from ..zigzag import zigzag_shard, zigzag_unshard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


# ---- memory -------------------------------------------------------------------
def _status_kib(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read())
    return int(m.group(1)) if m else 0


class PeakMemory:
    """Peak memory of a region on one rank.

    ``"cuda"``: ``torch.cuda.max_memory_allocated`` above the allocation at entry.
    ``"tracker"`` (CPU): the peak of live tensor bytes during the region,
    from PyTorch's dispatch-level ``MemTracker``
    (``torch.distributed._tools.mem_tracker``, a private tool; tensors only,
    including those alive at entry, no allocator slack).
    ``"rss"`` (CPU): growth of the resident set (Linux ``VmHWM`` after a reset
    through ``/proc/self/clear_refs``, minus ``VmRSS`` at entry); pages kept
    by the allocator from earlier work are reused without growth, so it can
    read low (even 0) for whatever runs after a larger run.
    """

    METHODS = {
        "cuda": "torch.cuda.max_memory_allocated above the allocation at entry",
        "tracker": "peak live tensor bytes in one iteration (torch MemTracker, CPU)",
        "rss": "RSS high-water growth (VmHWM reset via /proc/self/clear_refs)",
        "none": "not measured",
    }

    def __init__(self, device: torch.device, method: str = "auto"):
        if method == "auto":
            method = "cuda" if device.type == "cuda" else "tracker"
        if method not in self.METHODS:
            raise ValueError(f"memory method {method!r} not known; allowed: {list(self.METHODS)}")
        self.device, self.method, self.peak = device, method, 0

    @property
    def description(self) -> str:
        return self.METHODS[self.method]

    def __enter__(self) -> PeakMemory:
        if self.method == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.method == "rss":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _status_kib("VmRSS") * 1024
        elif self.method == "tracker":
            from torch.distributed._tools.mem_tracker import MemTracker

            self.tracker = MemTracker()
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.simplefilter("ignore")  # its module hooks warn about non-modules
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.method == "rss":
            self.peak = _status_kib("VmHWM") * 1024 - self.base
        elif self.method == "tracker":
            self.tracker.__exit__(*exc)
            self._quiet.__exit__(*exc)
            peak = self.tracker.get_tracker_snapshot("peak")
            self.peak = max((v.get("Total", 0) for v in peak.values()), default=0)


# ---- reference ------------------------------------------------------------------
def _reference(q, k, v, dout, causal: bool):
    """Dense float64 attention, one KV head group at a time (bounded memory)."""
    n, b, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    outs = [torch.empty(n, b, hq, d, dtype=torch.float64) for _ in range(2)]
    out, dq = outs
    dk = torch.empty(n, b, hkv, d, dtype=torch.float64)
    dv = torch.empty_like(dk)
    mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else None
    for h in range(hkv):
        hs = slice(h * g, (h + 1) * g)
        qh = q[:, :, hs].double().requires_grad_()
        kh = k[:, :, h : h + 1].double().requires_grad_()
        vh = v[:, :, h : h + 1].double().requires_grad_()
        s = torch.einsum("qbhd,kbzd->bhqk", qh, kh) * d**-0.5
        if mask is not None:
            s = s.masked_fill(mask, -math.inf)
        o = torch.einsum("bhqk,kbzd->qbhd", s.softmax(-1), vh)
        o.backward(dout[:, :, hs].double())
        out[:, :, hs], dq[:, :, hs] = o.detach(), qh.grad
        dk[:, :, h : h + 1], dv[:, :, h : h + 1] = kh.grad, vh.grad
    return out, dq, dk, dv


# ---- one rank -------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _attention_fn(strategy: Strategy, groups, causal: bool):
    if strategy.kind == "startrail":
        return lambda q, k, v, ledger: startrail_attention(
            q, k, v, groups, causal=causal, ledger=ledger
        )
    fn = peers.allgather_attention if strategy.kind == "allgather" else peers.ulysses_attention
    return lambda q, k, v, ledger: fn(q, k, v, None, causal=causal, ledger=ledger)


def _max_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _time_once(fn, device) -> float:
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _micro_tasks(args, rank, world, device, dtype) -> list[tuple[str, dict, object]]:
    """Kernel calls, buffer work, P2P exchanges and all-gathers to time: (table, row, fn)."""
    kern = get_kernel("auto", dtype)
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    s = args.seq_len // world
    scale = d**-0.5
    tasks: list[tuple[str, dict, object]] = []
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
            chunks = z.chunk(len(order))
            return torch.cat([chunks[i] for i in order])

        tasks.append(("buffer", {"bytes": 6 * 2 * g.numel() * g.element_size()}, buf))
    if world > 1:
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


def _micro_record(tasks, times: list[list[float]], stat=min) -> dict:
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


def _progress(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _run(rank: int, world: int, args) -> dict | None:
    torch.set_num_threads(args.threads)
    device = (
        torch.device(f"cuda:{torch.cuda.current_device()}") if args.cuda else torch.device("cpu")
    )
    dtype = DTYPES[args.dtype]
    causal = not args.full
    n = args.seq_len
    gen = torch.Generator().manual_seed(args.seed)
    qf = torch.randn(n, args.batch, args.heads, args.head_dim, generator=gen)
    kf = torch.randn(n, args.batch, args.kv_heads, args.head_dim, generator=gen)
    vf = torch.randn(n, args.batch, args.kv_heads, args.head_dim, generator=gen)
    dof = torch.randn(n, args.batch, args.heads, args.head_dim, generator=gen)

    def local(x):
        y = zigzag_shard(x, rank, world) if causal else x.chunk(world)[rank]
        return y.to(device=device, dtype=dtype).contiguous()

    q0, k0, v0, do = (local(x) for x in (qf, kf, vf, dof))
    ref = None
    if rank == 0 and not args.no_check:
        t0 = time.perf_counter()
        ref = _reference(qf, kf, vf, dof, causal)
        _progress(rank, f"float64 reference: {time.perf_counter() - t0:.1f}s")
    strategies = candidate_strategies(world, args.heads, args.kv_heads)
    if args.strategies:
        strategies = [s for s in strategies if s.name in args.strategies]
    shape = AttnShape(
        world,
        n // world,
        args.batch,
        args.heads,
        args.kv_heads,
        args.head_dim,
        elem_bytes=torch.empty((), dtype=dtype).element_size(),
        acc_bytes=8 if dtype == torch.float64 else 4,
        causal=causal,
    )
    steps, info = [], []
    for i, st in enumerate(strategies):
        t_start = time.perf_counter()
        groups = (
            StarTrailGroups.create(st.team_size, placement=st.placement)
            if st.kind == "startrail"
            else None
        )
        attn = _attention_fn(st, groups, causal)
        leaves = [x.clone().requires_grad_() for x in (q0, k0, v0)]

        def step(ledger=None, attn=attn, leaves=leaves):
            for x in leaves:
                x.grad = None
            out = attn(*leaves, ledger)
            out.backward(do)
            return out

        # One accounted run, checked against the reference.
        ledger = CommLedger()
        out = step(ledger)
        err = None
        if not args.no_check:
            mine = [out.detach(), *(x.grad for x in leaves)]
            errs = []
            for j, x in enumerate(mine):
                parts = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(parts, x.contiguous())
                if rank == 0:
                    full = zigzag_unshard(parts) if causal else torch.cat(parts)
                    r = ref[j]
                    errs.append(((full.double().cpu() - r).abs().max() / r.abs().max()).item())
            err = max(errs) if rank == 0 else None
        del out
        with PeakMemory(device, args.memory) as mem:
            step()
        peak = _max_over_ranks([float(mem.peak)], device)[0]
        for _ in range(args.warmup):
            step()
        summary = ledger.summary()
        led = _max_over_ranks([float(v) for v in summary.values()], device)
        steps.append(step)
        info.append((st, err, peak, dict(zip(summary, (int(v) for v in led)))))
        _progress(
            rank,
            f"[{i + 1}/{len(strategies)}] {st.name}: checked, memory, warm-up "
            f"({time.perf_counter() - t_start:.1f}s)",
        )
    # Interleaved rounds: each times every strategy once, then every microbenchmark,
    # so that load from elsewhere on the host falls on all of them alike.
    tasks = _micro_tasks(args, rank, world, device, dtype)
    times = [[] for _ in steps]
    micro_times = [[] for _ in tasks]
    for rnd in range(args.repeats):
        t_start = time.perf_counter()
        for j, fn in enumerate(steps):
            times[j].append(_time_once(fn, device))
        for j, (_, _, fn) in enumerate(tasks):
            micro_times[j].append(_time_once(fn, device))
        _progress(
            rank,
            f"round {rnd + 1}/{args.repeats}: "
            + ", ".join(f"{st.name} {t[-1] * 1e3:.0f} ms" for (st, *_), t in zip(info, times))
            + f" ({time.perf_counter() - t_start:.1f}s)",
        )
    flat = _max_over_ranks([t for ts in times + micro_times for t in ts], device)
    r_ = args.repeats
    times = [flat[j * r_ : (j + 1) * r_] for j in range(len(times))]
    off = len(steps) * r_
    micro_times = [flat[off + j * r_ : off + (j + 1) * r_] for j in range(len(tasks))]
    dims = {
        "batch": args.batch,
        "heads_q": args.heads,
        "head_dim": args.head_dim,
        "elem_bytes": torch.tensor([], dtype=dtype).element_size(),
        "grad_bytes": torch.tensor([], dtype=dtype).element_size(),  # the kernel's dK, dV
    }
    micro = {**_micro_record(tasks, micro_times), "dims": dims}
    micro_median = {**_micro_record(tasks, micro_times, statistics.median), "dims": dims}
    results = []
    for (st, err, peak, led), ts in zip(info, times):
        med = statistics.median(ts)
        q1, q3 = (
            statistics.quantiles(ts, n=4, method="inclusive")[::2] if len(ts) > 1 else (med, med)
        )
        results.append(
            {
                "strategy": st.name,
                "kind": st.kind,
                "team_size": st.team_size,
                "placement": st.placement if st.kind == "startrail" and st.team_size > 1 else "-",
                "median_s": med,
                "min_s": min(ts),
                "max_s": max(ts),
                "iqr_s": q3 - q1,
                "times_s": ts,
                "ledger_max_over_ranks": led,
                "model_bytes_max_over_ranks": {
                    k: max(b[k] for b in comm_bytes(st, shape)) for k in comm_bytes(st, shape)[0]
                },
                "peak_memory_bytes": peak,
                "max_rel_error": err,
            }
        )
    if rank != 0:
        return None
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fit = dict(
        num_ranks=world,
        memory_bytes=float(mem_total),
        backend=dist.get_backend(),
        cache_bytes=cache_bytes_per_core(device),
    )
    # Like for like: the model calibrated on each microbenchmark's fastest round predicts
    # the fastest round of each strategy; calibrated on their medians, the median.
    cluster = fit_cluster(micro, **fit)
    cluster_median = fit_cluster(micro_median, **fit)
    for r in results:
        st = Strategy(
            r["kind"], r["team_size"], r["placement"] if r["placement"] != "-" else "team"
        )
        pred = predict(st, cluster, shape).attn_s
        pred_med = predict(st, cluster_median, shape).attn_s
        r["predicted_s"] = pred
        r["predicted_over_measured"] = pred / r["min_s"]
        r["predicted_median_s"] = pred_med
        r["predicted_over_median"] = pred_med / r["median_s"]
    return {
        "config": {
            "nproc": world,
            "seq_len": n,
            "batch": args.batch,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "causal": causal,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "threads_per_rank": args.threads,
        },
        "environment": {
            "device": str(device),
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "host": platform.machine(),
        },
        "memory_method": PeakMemory(device, args.memory).description,
        "time_method": "forward+backward wall time, slowest rank per repeat (barrier before); "
        "repeats interleaved across strategies and microbenchmarks",
        "results": results,
        "calibration": {
            "microbenchmarks": micro,
            "cluster": cluster.__dict__,
            "microbenchmarks_median": micro_median,
            "cluster_median": cluster_median.__dict__,
        },
    }


# ---- output -------------------------------------------------------------------
def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"P={c['nproc']} ranks ({report['environment']['backend']}, "
        f"{report['environment']['device']}), seq {c['seq_len']}, batch {c['batch']}, "
        f"{c['heads']} q / {c['kv_heads']} kv heads, head_dim {c['head_dim']}, {c['dtype']}, "
        f"{'causal' if c['causal'] else 'full'}; {c['repeats']} repeats after {c['warmup']} warm-up",
        f"{'strategy':22s}{'median ms':>10s}{'IQR ms':>8s}{'fwd P2P':>10s}{'fwd coll':>10s}"
        f"{'bwd P2P':>10s}{'bwd coll':>10s}{'calls':>7s}{'peak MiB':>9s}{'max err':>9s}"
        f"{'min ms':>9s}{'model ms':>9s}{'mod/min':>9s}{'model med':>10s}{'mod/med':>9s}",
    ]
    mib = 2**20
    for r in report["results"]:
        led = r["ledger_max_over_ranks"]
        calls = sum(v for k, v in led.items() if k.endswith("_calls"))
        err = "-" if r["max_rel_error"] is None else f"{r['max_rel_error']:.1e}"
        lines.append(
            f"{r['strategy']:22s}{r['median_s'] * 1e3:10.2f}{r['iqr_s'] * 1e3:8.2f}"
            f"{led['fwd_p2p_bytes'] / mib:10.2f}{led['fwd_collective_bytes'] / mib:10.2f}"
            f"{led['bwd_p2p_bytes'] / mib:10.2f}{led['bwd_collective_bytes'] / mib:10.2f}"
            f"{calls:7d}{r['peak_memory_bytes'] / mib:9.1f}{err:>9s}"
            f"{r['min_s'] * 1e3:9.2f}{r['predicted_s'] * 1e3:9.2f}{r['predicted_over_measured']:9.2f}"
            f"{r['predicted_median_s'] * 1e3:10.2f}{r['predicted_over_median']:9.2f}"
        )
    lines.append(
        "bytes: MiB sent per rank (max over ranks, from the CommLedger); calls: P2P + collective, "
        f"fwd + bwd; peak: {report['memory_method']}; model: cost model calibrated on this run's "
        "microbenchmarks: fastest repeat of each vs the fastest repeat (min), median of each vs "
        "the median"
    )
    return "\n".join(lines)


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
    fig.suptitle(
        f"P={c['nproc']}, seq {c['seq_len']}, {c['dtype']}, {report['environment']['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- entry ----------------------------------------------------------------------
def _bench_rank(rank: int, world: int, args, out_file: str) -> None:
    report = _run(rank, world, args)
    if report is not None:
        with open(out_file, "w") as f:
            json.dump(report, f)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="startrail-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc", type=int, default=4, help="CPU ranks to spawn (ignored under torchrun)"
    )
    p.add_argument("--seq-len", type=int, default=4096, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--full", action="store_true", help="no causal mask (default: causal, zigzag)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--memory",
        choices=["auto", *PeakMemory.METHODS],
        default="auto",
        help="peak-memory method (auto: cuda on GPUs, tracker on CPU)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--strategies", nargs="*", help="only these names (e.g. ring startrail-C2-team)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="per-collective timeout, s")
    p.add_argument("--json", default="bench_attention.json", help="output JSON ('' = none)")
    p.add_argument("--png", default="bench_attention.png", help="output chart ('' = none)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the benchmark, print and write the outputs; exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark and return the report (rank 0's; ``{}`` on other torchrun ranks)."""
    p = build_parser()
    args = p.parse_args(argv)
    under_torchrun = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    args.cuda = under_torchrun and torch.cuda.is_available()
    for name in ("warmup", "threads"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if world < 1:
        p.error("--nproc must be >= 1")
    if args.seq_len % (2 * world):
        p.error(f"--seq-len {args.seq_len} must be divisible by 2*nproc = {2 * world}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.strategies:
        known = {s.name for s in candidate_strategies(world, args.heads, args.kv_heads)}
        bad = [s for s in args.strategies if s not in known]
        if bad:
            p.error(f"--strategies {bad} not valid here; allowed: {sorted(known)}")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.cuda else "cpu")
    if under_torchrun:
        if args.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if args.cuda else "gloo")
        try:
            report = _run(dist.get_rank(), world, args)
        finally:
            dist.destroy_process_group()
        if report is None:
            return {}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "report.json")
            spawn_local_ranks(
                _bench_rank,
                world,
                args,
                out_file,
                timeout=timedelta(seconds=args.timeout),
                threads=args.threads,
            )
            with open(out_file) as f:
                report = json.load(f)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        write_png(report, args.png)
        print(f"wrote {args.png}")
    return report
