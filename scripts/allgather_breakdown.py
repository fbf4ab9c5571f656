"""Where all-gather-KV attention's time goes on CPU gloo ranks (a diagnostic, not a test).

    PYTHONPATH=. python scripts/allgather_breakdown.py --nproc 4 --seq-len 4096

Times, interleaved over rounds (slowest rank per round, min and median over rounds):
the whole forward+backward of all-gather-KV and of ring attention; all-gather-KV's
kernel calls alone (its forward and backward calls, on the gathered K,V); the same
number of (q, k) pairs in square 1024 x 1024 full calls (the shape the cost model's
kernel calibration measures); its collectives (all-gather twice, reduce-scatter once);
a lone all-gather and a lone reduce-scatter; and its elementwise buffer work (stack,
reorders, zero-fills, accumulations), each on the benchmark's default shapes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from startrail_megatron.attention import startrail_attention
from startrail_megatron.comm import TeamComm
from startrail_megatron.groups import StarTrailGroups
from startrail_megatron.kernels import get_kernel
from startrail_megatron.peers import allgather_attention
from startrail_megatron.peers.common import natural_order
from startrail_megatron.schedule import allgather_calls
from startrail_megatron.zigzag import inverse_order, reorder_chunks


def _rank(rank: int, world: int, init: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    s, b, h, d = args.seq_len // world, 1, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(rank)
    q, k, v, do = (torch.randn(s, b, h, d, generator=gen) for _ in range(4))
    comm, kern, scale = TeamComm(None, world, None), get_kernel("auto", torch.float32), d**-0.5
    groups = StarTrailGroups.create(1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def whole(fn):
        def run():
            for x in leaves:
                x.grad = None
            fn(*leaves).backward(do)

        return run

    st = torch.stack((k, v), dim=1)
    order = natural_order(world)
    kvn = reorder_chunks(comm.all_gather(st, "kv"), order)
    calls = allgather_calls(rank, world, True, s)
    o, lse = torch.randn(s, b, h, d), torch.randn(b, h, s)

    def kernels():
        for qs, ks, cz in calls:
            kern.forward(q[qs], kvn[ks, 0], kvn[ks, 1], causal=cz, scale=scale)
        for qs, ks, cz in calls:
            kern.backward(
                do[qs], q[qs], kvn[ks, 0], kvn[ks, 1], o[qs], lse[..., qs], causal=cz, scale=scale
            )

    n_sq = max(1, round(2 * world * (s // 2) ** 2 / 1024**2))  # 2P c^2 pairs per rank
    qq, kk = torch.randn(1024, b, h, d), torch.randn(1024, b, h, d)
    oo, ll = kern.forward(qq, kk, kk, causal=False, scale=scale)

    def square():
        for _ in range(n_sq):
            kern.forward(qq, kk, kk, causal=False, scale=scale)
        for _ in range(n_sq):
            kern.backward(oo, qq, kk, kk, oo, ll, causal=False, scale=scale)

    dkv0 = torch.zeros(kvn.shape)
    grads = [torch.randn(ks.stop - ks.start, b, h, d) for _, ks, _ in calls]

    def buffers():
        torch.stack((k, v), dim=1)
        gathered = reorder_chunks(kvn, order)
        reorder_chunks(gathered, order)
        dkv, dq = torch.zeros(kvn.shape), torch.zeros(q.shape)
        for (qs, ks, _), g in zip(calls, grads):
            dkv[ks, 0] += g
            dkv[ks, 1] += g
            dq[qs] += q[qs]
        reorder_chunks(dkv, inverse_order(order))

    tasks = {
        "allgather fwd+bwd": whole(lambda *x: allgather_attention(*x, None, causal=True)),
        "ring fwd+bwd": whole(lambda *x: startrail_attention(*x, groups, causal=True)),
        "allgather kernel calls": kernels,
        f"same pairs, {n_sq} square 1024 calls": square,
        "allgather collectives": lambda: (
            comm.all_gather(st, "kv"),
            comm.all_gather(st, "kv"),
            comm.reduce_scatter(dkv0, "dkv"),
        ),
        "  one all-gather": lambda: comm.all_gather(st, "kv"),
        "  one reduce-scatter": lambda: comm.reduce_scatter(dkv0, "dkv"),
        "allgather buffer work": buffers,
    }
    times = {name: [] for name in tasks}
    for fn in tasks.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in tasks.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(
                f"{name:36s} min {t.min().item() * 1e3:7.1f} ms   "
                f"median {statistics.median(t.tolist()) * 1e3:7.1f} ms"
            )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.start_processes(
            _rank, args=(args.nproc, f"{tmp}/rdv", args), nprocs=args.nproc, start_method="spawn"
        )


if __name__ == "__main__":
    main()
