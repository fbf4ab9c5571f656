"""One rank of the benchmark: every strategy checked, measured and timed; the model calibrated.

``run_rank(rank, world, args)`` runs on every rank (spawned gloo ranks or
torchrun) with the same arguments and returns the report on rank 0, ``None``
elsewhere. Every rank makes the same collective calls in the same order:
each strategy's groups, its error check's all-gathers, the max-over-ranks
all-reduces, then the interleaved timed rounds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..auto_placement import auto_placement
from ..comm import CommLedger, CommOptions
from ..planner.cluster import ClusterSpec
from ..planner.shape import AttnShape
from ..planner.strategies import Strategy, attention_fn, candidate_strategies
from ..schedule import OWN_ROWS_FIRST_SETTINGS
from ..schedule.layout import nodes_from_hosts, valid_team_sizes
from ..testing import make_inputs, reference_attention, rel_err, shard, unshard
from .memory import PeakMemory
from .micro import micro_record, micro_tasks
from .rows import calibrate, strategy_row
from .timed_kernel import TimedKernel

__all__ = ["DTYPES", "run_rank"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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


def auto_placement_names(world: int) -> list[str]:
    """The names of ``--auto-placement``'s strategies: StarTrail at every valid C > 1 under
    the computed map."""
    return [f"startrail-C{c}-map" for c in valid_team_sizes(world) if c > 1]


def _auto_placement_strategies(args, world: int, shape: AttnShape) -> list[Strategy]:
    """``--auto-placement``: StarTrail at every valid C > 1 (those ``--strategies`` names,
    where given) under the map ``auto_placement`` computes for the ranks' nodes (a
    collective over every rank) and this run's attention call, on
    ``--placement-cluster-json``'s rates (default: the planner's ``AUTO_CLUSTER``)."""
    cluster = None
    if args.placement_cluster_json:
        with open(args.placement_cluster_json) as f:
            cluster = ClusterSpec(**json.load(f))
    out = []
    for c, name in zip((c for c in valid_team_sizes(world) if c > 1), auto_placement_names(world)):
        if not args.strategies or name in args.strategies:
            out.append(Strategy("startrail", c, auto_placement(c, shape=shape, cluster=cluster)))
    return out


def _progress(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _inputs(rank: int, world: int, args, device: torch.device, dtype, causal: bool):
    """(full-sequence q, k, v, dout in fp32, as the reference takes them; this rank's shards)."""
    full = make_inputs(
        args.seed,
        args.seq_len,
        args.batch,
        args.heads,
        args.kv_heads,
        args.head_dim,
        dtype=torch.float32,
    )
    local = (shard(x, rank, world, causal).to(device=device, dtype=dtype) for x in full)
    return full, tuple(x.contiguous() for x in local)


def _shape(args, world: int, dtype, causal: bool) -> AttnShape:
    return AttnShape(
        world,
        args.seq_len // world,
        args.batch,
        args.heads,
        args.kv_heads,
        args.head_dim,
        elem_bytes=torch.empty((), dtype=dtype).element_size(),
        acc_bytes=8 if dtype == torch.float64 else 4,
        causal=causal,
    )


def _max_rel_error(mine: list, ref, rank: int, world: int, causal: bool) -> float | None:
    """Largest relative error of out, dq, dk, dv (gathered on rank 0) against ``ref``."""
    errs = []
    for j, x in enumerate(mine):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        if rank == 0:
            errs.append(rel_err(unshard(parts, causal).cpu(), ref[j]))
    return max(errs) if rank == 0 else None


def comm_options(args, **kw) -> CommOptions:
    """The transfers' options of every timed call: ``--own-rows-first`` and ``kw``."""
    orf = OWN_ROWS_FIRST_SETTINGS[getattr(args, "own_rows_first", "auto")]
    return CommOptions(own_rows_first=orf, **kw)


def _nodes(world: int) -> list[int]:
    """Each rank's node: ranks with the same hostname share one, numbered in rank order
    (an emulated node has a hostname of its own: ``emulate``'s Note)."""
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return list(nodes_from_hosts(hosts))


def _link_bytes(ledger: CommLedger, rank: int, world: int, nodes: list[int]) -> list[dict]:
    """Per rank: the bytes it sent inside its node and to other nodes
    (``CommLedger.bytes_by_link`` with the ranks' nodes; CP rank = global rank here)."""
    mine = ledger.bytes_by_link(rank, nodes.__getitem__)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return every


def _prepare(
    st: Strategy, args, device: torch.device, causal: bool, local, ref, rank, world, nodes,
    kernel="auto",
):  # fmt: skip
    """One strategy's timed step, after one accounted run checked against the reference,
    a peak-memory measurement and the warm-up: (step, (strategy, error, peak, kept,
    ledger totals, overlap, bytes per link class per rank))."""
    attn = attention_fn(st, causal, kernel)  # StarTrail creates its groups here
    q0, k0, v0, do = local
    leaves = [x.clone().requires_grad_() for x in (q0, k0, v0)]
    base = comm_options(args)

    def step(ledger=None, comm=None, attn=attn, leaves=leaves):
        for x in leaves:
            x.grad = None
        out = attn(*leaves, ledger, base if comm is None else comm)
        out.backward(do)
        return out

    # One accounted run, checked against the reference; what its forward saves for the
    # backward is counted on the way.
    ledger = CommLedger()
    with _saved_storages() as saved:
        out = step(ledger)
    kept = _max_over_ranks([float(sum(saved.values()))], device)[0]
    links = _link_bytes(ledger, rank, world, nodes)
    err = mine = None
    if not args.no_check:
        # ``mine`` (this run's out and gradients) stays alive through the memory
        # measurement below, as it always has: the tracker counts it.
        mine = [out.detach(), *(x.grad for x in leaves)]
        err = _max_rel_error(mine, ref, rank, world, causal)
    del out
    with PeakMemory(device, args.memory) as mem:
        step()
    peak = _max_over_ranks([float(mem.peak)], device)[0]
    for _ in range(args.warmup):
        step()
    summary = ledger.summary()
    led = _max_over_ranks([float(v) for v in summary.values()], device)
    del mine
    hidden = _hidden_per_rank(step, None, device, world)
    totals = dict(zip(summary, (int(v) for v in led)))
    return step, (st, err, peak, kept, totals, hidden, links)


@contextlib.contextmanager
def _saved_storages():
    """What the forward keeps for the backward, inside: the distinct storages autograd
    saves (``torch.autograd.graph.saved_tensors_hooks``; data pointer -> bytes), inputs
    saved as they are included. The quantity of the paper's memory formula (ring 4 A,
    StarTrail (3C + 1) A), measured alike for every strategy."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def _hidden_per_rank(step, comm: CommOptions | None, device, world: int) -> dict | None:
    """One run with a ledger: per rank, the fraction of its transfers' time hidden behind
    other work and each transfer's waits (``CommLedger.waits``), gathered on every rank;
    ``None`` on CUDA, where waits do not block the host (``comm/overlap.py``)."""
    if device.type == "cuda":
        return None
    led = CommLedger()
    step(led, comm)
    mine = {"hidden": led.hidden(), "exposed_s": led.exposed_s(), "waits": led.waits()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return {
        "hidden_per_rank": [r["hidden"] for r in every],
        "exposed_s_per_rank": [r["exposed_s"] for r in every],
        "waits_per_rank": [r["waits"] for r in every],
    }


def _timed_rounds(steps, tasks, names: list[str], args, rank: int, device):
    """Interleaved rounds: each times every strategy once, then every microbenchmark, so
    that load from elsewhere on the host falls on all of them alike. Returns the
    slowest rank's times: (per strategy, per microbenchmark), one per round."""
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
            + ", ".join(f"{name} {t[-1] * 1e3:.0f} ms" for name, t in zip(names, times))
            + f" ({time.perf_counter() - t_start:.1f}s)",
        )
    flat = _max_over_ranks([t for ts in times + micro_times for t in ts], device)
    r_ = args.repeats
    times = [flat[j * r_ : (j + 1) * r_] for j in range(len(times))]
    off = len(steps) * r_
    micro_times = [flat[off + j * r_ : off + (j + 1) * r_] for j in range(len(tasks))]
    return times, micro_times


def _config(args, world: int, causal: bool) -> dict:
    return {
        "nproc": world,
        "workload": getattr(args, "workload", "gpt"),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "causal": causal,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads_per_rank": args.threads,
        "comm_delay_ms": getattr(args, "comm_delay_ms", 0.0),
        "comm_delay_ms_per_mib": getattr(args, "comm_delay_ms_per_mib", 0.0),
        "own_rows_first": getattr(args, "own_rows_first", "auto"),
        "timed_kernels_flops": getattr(args, "timed_kernels_flops", None),
    }


def _environment(device: torch.device) -> dict:
    return {
        "device": str(device),
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "host": platform.machine(),
    }


def run_rank(rank: int, world: int, args) -> dict | None:
    """The benchmark on this rank: the report on rank 0, ``None`` on the others."""
    torch.set_num_threads(args.threads)
    device = (
        torch.device(f"cuda:{torch.cuda.current_device()}") if args.cuda else torch.device("cpu")
    )
    dtype = DTYPES[args.dtype]
    causal = not args.full
    full, local = _inputs(rank, world, args, device, dtype, causal)
    ref = None
    if rank == 0 and not args.no_check:
        t0 = time.perf_counter()
        ref = reference_attention(*full, causal)
        _progress(rank, f"float64 reference: {time.perf_counter() - t0:.1f}s")
    shape = _shape(args, world, dtype, causal)
    strategies = candidate_strategies(world, args.heads, args.kv_heads)
    if getattr(args, "auto_placement", False):
        strategies += _auto_placement_strategies(args, world, shape)
    if args.strategies:
        strategies = [s for s in strategies if s.name in args.strategies]
    steps, info = [], []
    nodes = _nodes(world)
    timed_flops = getattr(args, "timed_kernels_flops", None)
    timed = TimedKernel(timed_flops) if timed_flops else None  # Note [timed kernels]
    for i, st in enumerate(strategies):
        t_start = time.perf_counter()
        step, row = _prepare(
            st, args, device, causal, local, ref, rank, world, nodes, timed or "auto"
        )
        steps.append(step)
        info.append(row)
        _progress(
            rank,
            f"[{i + 1}/{len(strategies)}] {st.name}: checked, memory, warm-up "
            f"({time.perf_counter() - t_start:.1f}s)",
        )
    # the kernel microbenchmarks time the strategies' kernel: timed calls under the host's
    # load give the model their real fixed cost per call
    tasks = micro_tasks(args, rank, world, device, dtype, timed)
    names = [st.name for st in strategies]
    n_st = len(steps)
    delay_s = getattr(args, "comm_delay_ms", 0.0) / 1e3
    per_mib = getattr(args, "comm_delay_ms_per_mib", 0.0) / 1e3
    delayed: list[dict | None] = []
    if delay_s or per_mib:  # the same steps with the injected delay, overlapped and not
        slow = dict(delay_s=delay_s, delay_s_per_mib=per_mib)
        modes = (comm_options(args, **slow), comm_options(args, overlap=False, **slow))
        for comm, label in zip(modes, (" +delay", " +delay no-overlap")):
            steps += [functools.partial(fn, comm=comm) for fn in steps[:n_st]]
            names += [nm + label for nm in names[:n_st]]
        delayed = [_hidden_per_rank(fn, modes[0], device, world) for fn in steps[:n_st]]
    times, micro_times = _timed_rounds(steps, tasks, names, args, rank, device)
    dims = {
        "batch": args.batch,
        "heads_q": args.heads,
        "head_dim": args.head_dim,
        "elem_bytes": torch.tensor([], dtype=dtype).element_size(),
        "grad_bytes": torch.tensor([], dtype=dtype).element_size(),  # the kernel's dK, dV
    }
    micro = {**micro_record(tasks, micro_times), "dims": dims}
    micro_median = {**micro_record(tasks, micro_times, statistics.median), "dims": dims}
    results = [strategy_row(*row, ts, shape) for row, ts in zip(info, times)]
    for j, r in enumerate(results if delay_s or per_mib else []):
        ov, no = times[n_st + j], times[2 * n_st + j]
        r["delay"] = {
            "delay_s": delay_s,
            "delay_s_per_mib": per_mib,
            "overlap_median_s": statistics.median(ov),
            "no_overlap_median_s": statistics.median(no),
            "overlap_times_s": ov,
            "no_overlap_times_s": no,
            "overlap": delayed[j],
        }
    if rank != 0:
        return None
    cluster, cluster_median = calibrate(
        strategies, results, micro, micro_median, shape, world, device,
        comm_options(args).own_rows_first, timed_flops,
    )  # fmt: skip
    return {
        "config": _config(args, world, causal),
        "environment": {**_environment(device), "node_of_rank": nodes},
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
