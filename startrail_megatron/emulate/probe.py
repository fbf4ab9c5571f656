"""One rank of the link probe: times transfers between two ranks of one node and of two
nodes (``python -m startrail_megatron.emulate.probe OUT.json [--mib M] [--fail-rank R]``).

Run on every rank of an emulated cluster (``EmulatedCluster.start``): rank 0 exchanges
``--mib`` MiB with rank 1 (the same node when nodes have two ranks or more) and with the
first rank of node 1, each way at once (``comm.P2PComm``'s receives-first exchange, the
transfer StarTrail's ring steps make), the other ranks idle; then, where the ring crosses
nodes, every rank at once sends as much to the next rank and receives from the previous
(``ring_step``: one ring-attention step, every node's link and the host's cores busy as
in the strategies) and an all-to-all over every rank (Ulysses' collective: each rank's
``--mib`` MiB in equal parts to every rank, many flows on each node's link); each best of
five, the slowest rank's. Rank 0 writes the seconds,
the bytes and every rank's hostname and node to ``OUT.json``. ``--fail-rank R`` makes rank R
exit with code 3 first (the tests' failing rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["main"]


def _exchange_time(rank: int, pair: tuple[int, int], nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` (every rank calls it; only the pair moves data): the two ranks
    of ``pair`` send ``nbytes`` to each other at once, receives posted first."""
    x = torch.zeros(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        if rank not in pair:
            continue
        peer = pair[1] if rank == pair[0] else pair[0]
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.irecv, y, peer), dist.P2POp(dist.isend, x, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        best = min(best, time.perf_counter() - t0)
    return best


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _ring_step_time(rank: int, world: int, nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` of the slowest rank's time: every rank sends ``nbytes`` to the
    next rank and receives as much from the previous one, all at once."""
    x = torch.zeros(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.irecv, y, (rank - 1) % world),
               dist.P2POp(dist.isend, x, (rank + 1) % world)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        best = min(best, _slowest(time.perf_counter() - t0))
    return best


def _all_to_all_time(nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` of the slowest rank's time: an all-to-all over every rank
    (``all_to_all_single``, Ulysses' collective), ``nbytes`` per rank in equal parts."""
    world = dist.get_world_size()
    n = nbytes // 4 // world * world
    x, y = torch.zeros(n), torch.empty(n)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x)
        best = min(best, _slowest(time.perf_counter() - t0))
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mib", type=float, default=2.0)
    p.add_argument("--fail-rank", type=int, default=-1)
    args = p.parse_args(argv)
    rank = int(os.environ["RANK"])
    if rank == args.fail_rank:
        sys.exit(3)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world, per_node = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
        nbytes = int(args.mib * 2**20)
        pairs = {}
        if per_node > 1:
            pairs["intra_node"] = 1
        if world > per_node:
            pairs["inter_node"] = per_node
        times = {name: _exchange_time(rank, (0, other), nbytes) for name, other in pairs.items()}
        if world > per_node:
            times["ring_step"] = _ring_step_time(rank, world, nbytes)
            times["all_to_all"] = _all_to_all_time(nbytes)
        hosts: list = [None] * world
        dist.all_gather_object(
            hosts, (socket.gethostname(), int(os.environ.get("STARTRAIL_EMULATED_NODE", -1)))
        )
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"bytes": nbytes, "seconds": times, "hosts": hosts}, f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
