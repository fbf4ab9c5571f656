"""Per-batch layouts measured on CPU ranks (issue 49, item 4's measured half).

    python scripts/batch_measure.py [--dist stdlib lognormal] [--ranks 8 16]
        [--batch-tokens 16384] [--batches 2] [--layer-ffn N] [--json OUT.json]

The batches are ``scripts/batch_schedule_bench.py``'s (the standard library's ``.py``
token lengths, and Megatron's lognormal), scaled to what 2 CPU cores attend in minutes.
Each is run forward and backward (exact attention of every document, causal, fp32; 4 query
heads and 2 KV heads of 32) on P gloo ranks under each layout, side by side:

- ``static ring`` / ``static StarTrail``: every document on all P ranks, packed
  (``batch_attention`` with one block), C = 1 / the best C on the model;
- ``megatron``: megatron-core's ``BalancedCPScheduler`` (imported; ``max_seq_len_per_rank``
  the batch's tokens / P, or the longest document / P where larger), each document on the
  ranks of its round that hold it, one ``startrail_attention`` call per document (as
  megatron-core runs its sub-samples), with the largest team size up to 2 that fits;
- ``ours``: ``schedule_batch`` (packed blocks, ``batch_attention``).

``--layer-ffn N``: each call is a layer's, not the attention's alone: every rank also runs
the layer's GEMMs (QKV and output projections, an MLP of N, on hidden 128 = the heads')
forward and backward on the tokens it holds (one per document for Megatron's, as its
sub-samples run whole layers), ours is scheduled with that layer priced
(``schedule_batch(model=...)``), and one more row, ``ours, pairs only``, is ours scheduled
on the attention alone. N = 24576 gives a GPT-7B layer's GEMM work per token relative to its
attention per causal pair (24,576 x the pair's FLOPs).

``--emulate NODESxRANKS --inter-node RATE`` (root): the same on an emulated cluster
(``emulate/``: network namespaces, each node's link limited to RATE), where the wall clock
counts the transfers; the model's cluster is then the planner's emulated one
(``bench.emulated.emulated_cluster_spec``, its links from the link probe run in the
cluster first, as ``startrail-bench --emulate`` does) with this machine's kernel rate
shared by the ranks (cores / ranks of it each, where they outnumber the cores).

``--timed-kernels [RATE]`` (Note [timed kernels], ``bench/timed_kernel.py``): every
attention call and the layer's GEMMs wait their modelled time (at ``host``, the default:
this machine's rates shared by the ranks, as the model prices them; a number: GFLOP/s per
rank; a cluster preset such as ``h100-ib``, with ``--emulate``: the rate that gives each
emulated node that preset's ratio of attention FLOP/s to off-node bytes/s,
``ratio_matched_flops``) instead of computing, so the ranks compute side by side as
accelerators would, and the wall clock is the slowest rank's path with the transfers, not
the host's total work; the schedules, merges and transfers stay real, the numbers do not
(no check runs here either way). Compare layouts on the wall clock then.

Per layout: each rank's thread CPU time of its forward and backward (``time.thread_time``:
P ranks share 2 cores, so wall clock says little beyond P = 2; the critical path is the
slowest rank's), the wall clock between barriers, the most bytes a rank sent (its
``CommLedger``), the balance of causal pairs (max / mean over ranks), and the model's
makespan for the same layout on a cluster of this machine's measured kernel rate
(``--attn-gflops``, measured here when 0) and ``--link-gbps``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 32
TEAM_CAP = 2


def _layouts(lengths, p: int, prices, model=None):
    """{name: BatchLayout or the megatron runs [(doc, k, start)], None where refused}."""
    from startrail_megatron.planner.batch import schedule_batch
    from startrail_megatron.schedule.batch import BatchBlock, BatchLayout
    from startrail_megatron.schedule.layout import valid_team_sizes

    best = min(valid_team_sizes(p), key=lambda c: (prices.block_price(p, c)[0], c))
    whole = tuple(range(len(lengths)))
    out = {
        "static ring": BatchLayout(p, tuple(lengths), (BatchBlock(0, p, 1, whole),)),
        f"static StarTrail C={best}": BatchLayout(
            p, tuple(lengths), (BatchBlock(0, p, best, whole),)
        ),
        "ours": schedule_batch(
            lengths, p, heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM, elem_bytes=4,
            cluster=prices.cluster, model=model,
        ),
    }  # fmt: skip
    if model is not None:
        out["ours, pairs only"] = schedule_batch(
            lengths, p, heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM, elem_bytes=4,
            cluster=prices.cluster,
        )  # fmt: skip
    out["megatron"] = _megatron_runs(lengths, p)
    return out


def _megatron_runs(lengths, p: int) -> list | None:
    """megatron-core's scheduler's runs (``max_seq_len_per_rank``: the batch's tokens / P,
    or the longest document / P where larger), None where it refuses the batch or puts a
    document on ranks megatron-core has no group for."""
    from startrail_megatron.megatron.training.hybrid import megatron_rounds
    from startrail_megatron.schedule.batch import runs_from_rounds

    cap = max(sum(lengths) // p, math.ceil(max(lengths) / p))
    try:
        return runs_from_rounds(megatron_rounds(lengths, p, cap))
    except ValueError:
        return None


def _dense(ffn: int):
    """The layer's GEMMs on a rank's tokens (``--layer-ffn``), forward and backward: a
    callable of the token count, or None without a layer. FLOPs as the planner counts them
    (``prediction._dense_flops``): QKV and output projections, a GELU MLP of ``ffn``."""
    if not ffn:
        return None
    h, kv = HEADS_Q * HEAD_DIM, HEADS_KV * HEAD_DIM
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(h, n, generator=g) / h**0.5).requires_grad_() for n in (h + 2 * kv, h, ffn)]
    w4 = (torch.randn(ffn, h, generator=g) / ffn**0.5).requires_grad_()

    def run(tokens: int) -> None:
        for start in range(0, tokens, 2048):  # tiled: the same FLOPs in bounded memory
            x = torch.randn(min(2048, tokens - start), h, generator=g)
            qkv, proj, up = (x @ w for w in ws)
            (qkv.sum() + proj.sum() + (torch.nn.functional.gelu(up) @ w4).sum()).backward()

    return run


def _rank(rank: int, world: int, plan: list, out_path: str) -> None:
    from startrail_megatron.attention import startrail_attention
    from startrail_megatron.batch_attention import (
        BatchGroups,
        batch_attention,
        shard_batch,
    )
    from startrail_megatron.comm import CommLedger
    from startrail_megatron.schedule.batch import rank_runs
    from startrail_megatron.schedule.layout import team_size_within
    from startrail_megatron.zigzag import zigzag_shard

    torch.set_num_threads(1)
    groups = BatchGroups.create()
    dense = _dense(plan[0].get("layer_ffn", 0)) if plan else None
    timed = plan[0].get("timed") if plan else None
    kern = "auto"
    if timed:  # Note [timed kernels]: waits of the modelled time instead of arithmetic
        from startrail_megatron.bench.timed_kernel import TimedKernel, dense_wait

        kern = TimedKernel(timed["attn_flops"], 2.5, timed["call_s"])
        if dense is not None:
            dense = dense_wait(timed["dense_flops_per_token"], timed["matmul_flops"])
    results = []
    for item in plan:
        lengths = item["lengths"]
        total = sum(lengths)
        g = torch.Generator().manual_seed(item["seed"])
        q = torch.randn(total, 1, HEADS_Q, HEAD_DIM, generator=g)
        k = torch.randn(total, 1, HEADS_KV, HEAD_DIM, generator=g)
        v = torch.randn(total, 1, HEADS_KV, HEAD_DIM, generator=g)
        dout = torch.randn(total, 1, HEADS_Q, HEAD_DIM, generator=g)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        names = list(item["layouts"])
        if item["index"] == 0:  # one untimed pass first: the first calls pay for warm-up
            names = [names[0], *names]
        for j, name in enumerate(names):
            lay = item["layouts"][name]
            if lay is None:
                continue
            ledger = CommLedger()
            dist.barrier()
            w0, t0 = time.perf_counter(), time.thread_time()
            if isinstance(lay, list):  # megatron: one call per document on its ranks
                for d, size, _start in rank_runs(lay, rank):
                    pad = (-lengths[d]) % (2 * size)
                    parts = []
                    for x in (q, k, v, dout):
                        doc = x[cu[d] : cu[d + 1]]
                        if pad:
                            doc = torch.cat([doc, doc.new_zeros(pad, *doc.shape[1:])])
                        parts.append(zigzag_shard(doc, rank % size, size).contiguous())
                    ql, kl, vl, dl = (t.requires_grad_(i < 3) for i, t in enumerate(parts))
                    grp = groups.get(size, team_size_within(size, TEAM_CAP))
                    out = startrail_attention(
                        ql, kl, vl, grp, causal=True, ledger=ledger, kernel=kern
                    )
                    out.backward(dl)
                    if dense is not None:
                        dense(ql.shape[0])
            else:
                ql, kl, vl, dl = (shard_batch(x, lay, rank) for x in (q, k, v, dout))
                ql, kl, vl = (t.contiguous().requires_grad_() for t in (ql, kl, vl))
                # every rank calls it, an idle one too (it joins the layout check)
                out = batch_attention(
                    ql, kl, vl, lay, groups, causal=True, ledger=ledger, kernel=kern
                )
                out.backward(dl)
                if dense is not None and ql.shape[0]:
                    dense(ql.shape[0])
            cpu = time.thread_time() - t0
            dist.barrier()
            wall = time.perf_counter() - w0
            if not (item["index"] == 0 and j == 0):
                results.append((item["index"], name, cpu, wall, ledger.bytes()))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def _best_call(n: int, repeats: int) -> float:
    """The best of ``repeats`` forward + backward calls on ``n`` causal tokens of the kernel
    StarTrail picks here (``kernel="auto"``), one thread, in seconds."""
    from startrail_megatron.kernels.choice import resolve_kernel

    torch.set_num_threads(1)
    q = torch.randn(n, 1, HEADS_Q, HEAD_DIM)
    k = torch.randn(n, 1, HEADS_KV, HEAD_DIM)
    v = torch.randn(n, 1, HEADS_KV, HEAD_DIM)
    kern, scale = resolve_kernel(q, "auto", None)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, lse = kern.forward(q, k, v, causal=True, scale=scale)
        kern.backward(torch.ones_like(out), q, k, v, out, lse, causal=True, scale=scale)
        best = min(best, time.perf_counter() - t0)
    return best


def _attn_flops() -> float:
    """This machine's attention rate on one thread (flop/s): one causal 2048-token call,
    forward and backward, counted as the planner counts it (4 x head size x query heads per
    causal pair, the backward 2.5x)."""
    n = 2048
    return 4 * HEAD_DIM * HEADS_Q * n * (n + 1) / 2 * (1 + 2.5) / _best_call(n, 3)


def _call_overhead() -> float:
    """This machine's fixed cost of one kernel call (s), as the planner charges it
    (``kernel_overhead`` forward, ``attn_bwd_ratio`` (2.5) times it backward): the best of
    20 forward + backward calls on 16 tokens, whose FLOPs are negligible, over 3.5."""
    return _best_call(16, 20) / (1 + 2.5)


def _dense_flops_per_token(ffn: int) -> float:
    """``_dense``'s FLOPs per token, forward and backward, as the planner counts them."""
    h, kv = HEADS_Q * HEAD_DIM, HEADS_KV * HEAD_DIM
    return 3 * 2 * (h * (h + 2 * kv) + h * h + 2 * h * ffn)


def _matmul_flops(ffn: int) -> float:
    """This machine's GEMM rate on one thread (flop/s): ``_dense`` on 2048 tokens, counted
    as the planner counts it (forward and a backward of twice its FLOPs)."""
    torch.set_num_threads(1)
    n = 2048
    run, best = _dense(ffn), math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        run(n)
        best = min(best, time.perf_counter() - t0)
    return n * _dense_flops_per_token(ffn) / best


def main(argv: list[str] | None = None) -> None:
    import batch_schedule_bench as B

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", nargs="+", default=["stdlib", "lognormal"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--batch-tokens", nargs="+", type=int, default=[16384])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--attn-gflops", type=float, default=0.0, help="0: measured here")
    ap.add_argument(
        "--call-us",
        type=float,
        default=-1.0,
        help="the model's fixed cost per kernel call, microseconds (-1: measured here)",
    )
    ap.add_argument("--link-gbps", type=float, default=8.0, help="the model's link, Gbit/s")
    ap.add_argument(
        "--layer-ffn",
        type=int,
        default=0,
        help="run the layer's GEMMs too, with an MLP of this size (0: attention only)",
    )
    ap.add_argument(
        "--timed-kernels",
        nargs="?",
        const="host",
        default=None,
        metavar="RATE",
        help="kernels and GEMMs wait their modelled time instead of computing "
        "(Note [timed kernels]): ranks compute side by side, as on accelerators. RATE: "
        "'host' (the default: this machine's rate shared by the ranks), a number (GFLOP/s "
        "per rank), or a cluster preset (with --emulate: the rate that gives a node the "
        "preset's ratio of attention FLOP/s to off-node bytes/s)",
    )
    ap.add_argument("--json", default="")
    ap.add_argument("--emulate", default=None, help="NODESxRANKS: on an emulated cluster")
    ap.add_argument("--inter-node", default="200mbit", help="with --emulate: each node's link")
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one rank of an emulated run (torchrun's variables set by the parent)
        with open(args.worker[0], "rb") as f:
            plan = pickle.load(f)
        dist.init_process_group("gloo", timeout=timedelta(minutes=30))
        try:
            _rank(dist.get_rank(), dist.get_world_size(), plan, args.worker[1])
        finally:
            dist.destroy_process_group()
        return
    _check_timed(ap, args)
    flops = args.attn_gflops * 1e9 or _attn_flops()
    print(f"kernel rate on one thread: {flops / 1e9:.1f} GFLOP/s (the model's attn_flops)")
    args.call_s = args.call_us * 1e-6 if args.call_us >= 0 else _call_overhead()
    print(f"fixed cost per kernel call: {args.call_s * 1e6:.0f} us (kernel_overhead)")
    if args.layer_ffn:
        args.matmul_flops = _matmul_flops(args.layer_ffn)
        print(f"GEMM rate on one thread: {args.matmul_flops / 1e9:.1f} GFLOP/s (matmul_flops)")
    spec = emu = None
    if args.emulate:
        from startrail_megatron.emulate import EmulatedCluster, EmulationSpec

        spec = EmulationSpec.from_flags(ap, args.emulate, args.inter_node, None)
        args.ranks = [spec.world_size]
        emu = EmulatedCluster(spec)
        emu.build()
    try:
        rows = _measure(args, B, spec, emu, flops)
    finally:
        if emu is not None:
            emu.teardown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _measure(args, B, spec, emu, flops: float) -> list[dict]:
    from startrail_megatron.planner.batch import BatchPrices
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS
    from startrail_megatron.spawn import spawn_local_ranks

    rows = []
    ports = iter(range(29560, 29660))
    model_cluster = None
    if emu is not None:  # the links as the probe finds them, as startrail-bench --emulate
        model_cluster = _emulated_cluster(
            spec, flops, _probe(emu, next(ports)), getattr(args, "matmul_flops", flops)
        ).with_(kernel_overhead=args.call_s * max(1.0, spec.world_size / (os.cpu_count() or 1)))
        print(f"the model's cluster: {model_cluster}")
    for dist_name in args.dist:
        pool = B.stdlib_lengths() if dist_name == "stdlib" else B.lognormal_lengths(20000, 1)
        for p in args.ranks:
            if spec is None:
                cl = CLUSTER_PRESETS["h100-ib"].with_(
                    name="this machine's CPU ranks", gpus_per_node=p, num_nodes=1,
                    attn_flops=flops, intra_bw=args.link_gbps * 1e9 / 8, overlap=False,
                    matmul_flops=getattr(args, "matmul_flops", flops),
                    kernel_overhead=args.call_s, attn_bwd_ratio=2.5,
                )  # fmt: skip
            else:
                cl = model_cluster
            timed = None
            if args.timed_kernels:  # the waits are the model's kernel terms, no more
                from startrail_megatron.bench.timed_kernel import timed_cluster

                # transfers stay priced as the cluster has them (not overlapped): the fixed
                # cost per call here is one quiet thread's (--call-us), not one under the
                # run's load as startrail-bench fits it, and priced as overlapping the
                # kernels the transfers look free to the scheduler (section 17)
                rate = _timed_rate(args, spec, cl)
                cl = cl.with_(matmul_flops=cl.matmul_flops * rate / cl.attn_flops)
                cl = timed_cluster(cl, rate, overlap=cl.overlap)
                print(f"timed kernels at {rate / 1e9:.3g} GFLOP/s per rank ({args.timed_kernels})")
                timed = {"attn_flops": cl.attn_flops, "matmul_flops": cl.matmul_flops,
                         "call_s": 0.0,
                         "dense_flops_per_token": _dense_flops_per_token(args.layer_ffn)}  # fmt: skip
            layer = None
            if args.layer_ffn:  # the layer _dense runs, as the planner's ModelSpec
                from startrail_megatron.planner.cluster import ModelSpec

                layer = ModelSpec("layer", 1, HEADS_Q * HEAD_DIM, HEADS_Q, HEADS_KV, args.layer_ffn)
            prices = BatchPrices(cl, HEADS_Q, HEADS_KV, HEAD_DIM, 4, model=layer)
            for tokens in args.batch_tokens:
                plan, model = [], {}
                for i, lengths in enumerate(B.batches(pool, tokens, args.batches, seed=p + tokens)):
                    lays = _layouts(lengths, p, prices, layer)
                    plan.append(dict(index=i, seed=i, lengths=lengths, layouts=lays,
                                     layer_ffn=args.layer_ffn, timed=timed))  # fmt: skip
                    for name, lay in lays.items():
                        if lay is None:
                            continue
                        if isinstance(lay, list):
                            mk = _megatron_model(lengths, lay, prices)
                            bal, toks = _runs_balance(lengths, lay, p)
                        else:
                            mk, bal = max(prices.layout_seconds(lay)), lay.balance()
                            toks = lay.rank_tokens()
                        model[(i, name)] = (mk, bal, max(toks) / statistics.fmean(toks))
                out = f"/tmp/batch_measure_{os.getpid()}.json"
                t0 = time.perf_counter()
                if spec is None:
                    spawn_local_ranks(_rank, p, plan, out, timeout=timedelta(minutes=30))
                else:
                    _run_emulated(emu, plan, out, next(ports))
                with open(out) as f:
                    per_rank = json.load(f)
                os.unlink(out)
                acc: dict[str, list] = {}
                for i, item in enumerate(plan):
                    for name in item["layouts"]:
                        got = [r for rr in per_rank for r in rr if r[0] == i and r[1] == name]
                        if not got:
                            continue
                        mk, bal, tbal = model[(i, name)]
                        acc.setdefault(name, []).append(dict(
                            cpu_critical_s=max(r[2] for r in got),
                            cpu_mean_s=statistics.fmean(r[2] for r in got),
                            wall_s=max(r[3] for r in got), max_bytes=max(r[4] for r in got),
                            balance=bal, token_balance=tbal, model_s=mk,
                        ))  # fmt: skip
                base = next(v for k, v in acc.items() if k.startswith("static StarTrail"))
                base_cpu = statistics.fmean(x["cpu_critical_s"] for x in base)
                base_wall = statistics.fmean(x["wall_s"] for x in base)
                where = f" on {cl.name}" if spec is not None else ""
                print(f"{dist_name} P={p}{where}, {tokens} tokens per batch, {len(plan)} batches "
                      f"({time.perf_counter() - t0:.0f} s):")  # fmt: skip
                for name, vals in acc.items():
                    row = {"dist": dist_name, "ranks": p, "batch_tokens": tokens, "layout": name,
                           "batches": len(vals), "emulated": args.emulate,
                           "inter_node": args.inter_node if args.emulate else None,
                           "layer_ffn": args.layer_ffn,
                           "timed_kernels": bool(args.timed_kernels),
                           "timed_kernels_flops": timed["attn_flops"] if timed else None}  # fmt: skip
                    for key in vals[0]:
                        row[key] = statistics.fmean(x[key] for x in vals)
                    row["throughput_vs_static_startrail"] = base_cpu / row["cpu_critical_s"]
                    row["wall_vs_static_startrail"] = base_wall / row["wall_s"]
                    rows.append(row)
                    print(f"  {name:24s} critical CPU {row['cpu_critical_s']:7.2f} s "
                          f"(x{row['throughput_vs_static_startrail']:4.2f}), mean "
                          f"{row['cpu_mean_s']:6.2f} s, wall {row['wall_s']:6.2f} s "
                          f"(x{row['wall_vs_static_startrail']:4.2f}), balance "
                          f"{row['balance']:5.2f}, tokens {row['token_balance']:5.2f}, max sent {row['max_bytes'] / 2**20:6.1f} MiB, "
                          f"model {row['model_s']:6.2f} s")  # fmt: skip
    return rows


def _probe(emu, port: int) -> dict:
    """The link probe's report (``emulate.probe``) run in the emulated cluster."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.json")
        emu.run([sys.executable, "-m", "startrail_megatron.emulate.probe", path], 600, port)
        with open(path) as f:
            return json.load(f)


def _check_timed(ap, args) -> None:
    """``--timed-kernels RATE``: 'host', a number > 0 or a preset (with ``--emulate``);
    ``ap.error`` naming the flag otherwise, before anything starts."""
    from startrail_megatron.bench.timed_kernel import timed_rate
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS

    v = args.timed_kernels
    if v is None or v == "host" or (v in CLUSTER_PRESETS and args.emulate):
        return
    try:
        ok = bool(timed_rate(v))  # a preset without --emulate raises
    except ValueError:
        ok = False
    if not ok:
        ap.error(
            f"--timed-kernels {v!r}: 'host', a number of GFLOP/s per rank > 0, or (with "
            f"--emulate) a cluster preset: {sorted(CLUSTER_PRESETS)}"
        )


def _timed_rate(args, spec, cl) -> float:
    """A rank's timed-kernel rate (FLOP/s) for ``--timed-kernels``: the model cluster's own
    (``host``), or the number or preset given (``bench.timed_kernel.timed_rate``: a preset's
    node ratio on the emulated node link, at the link's set rate)."""
    from startrail_megatron.bench.timed_kernel import timed_rate

    v = args.timed_kernels
    return cl.attn_flops if v == "host" else timed_rate(v, spec)


def _emulated_cluster(spec, flops: float, probe: dict, gemm_flops: float):
    """The planner's emulated cluster (``bench.emulated.emulated_cluster_spec``: the links
    from the probe) with this machine's kernel rate, shared: the ranks' kernels run on the
    host's cores together, so each rank's wall-clock rate is the single thread's times
    cores / ranks where the ranks outnumber the cores."""
    from startrail_megatron.bench.emulated import emulated_cluster_spec

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = min(1.0, (os.cpu_count() or 1) / spec.world_size)
    return emulated_cluster_spec(spec, probe, None, mem).with_(
        attn_flops=flops * share, matmul_flops=gemm_flops * share
    )


def _run_emulated(emu, plan: list, out: str, port: int) -> None:
    """Every rank of ``plan`` in the emulated cluster ``emu``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.pkl")
        with open(path, "wb") as f:
            pickle.dump(plan, f)
        emu.run([sys.executable, os.path.abspath(__file__), "--worker", path, out], 3600, port)


def _megatron_model(lengths, runs, prices) -> float:
    """The model's makespan of megatron's runs: each rank's documents one after the other."""
    from startrail_megatron.schedule.batch import doc_pairs
    from startrail_megatron.schedule.layout import team_size_within

    per: dict[int, float] = {}
    for d, k, start in runs:
        c = team_size_within(k, TEAM_CAP)
        t = prices.rank_seconds(k, c, doc_pairs(lengths[d]), lengths[d])
        for r in range(start, start + k):
            per[r] = per.get(r, 0.0) + t
    return max(per.values())


def _runs_balance(lengths, runs, p: int) -> tuple[float, list[int]]:
    """(the balance of causal pairs, each rank's tokens) of megatron's runs."""
    from startrail_megatron.schedule.batch import doc_pairs, rank_doc_tokens

    pairs, toks = [0.0] * p, [0] * p
    for d, k, start in runs:
        for r in range(start, start + k):
            pairs[r] += doc_pairs(lengths[d]) / k
            toks[r] += rank_doc_tokens(lengths[d], k)
    return max(pairs) / statistics.fmean(pairs), toks


if __name__ == "__main__":
    main()
