"""One rank of the link probe: times transfers between two ranks of one node and of two
nodes (``python -m startrail_megatron.emulate.probe OUT.json [--mib M]
[--cpu-seconds S]``).

Run on every rank of an emulated cluster (``EmulatedCluster.start``): rank 0 exchanges
``--mib`` MiB with rank 1 (the same node when nodes have two ranks or more) and with the
first rank of node 1, each way at once (``comm.P2PComm``'s receives-first exchange, the
transfer StarTrail's ring steps make), the other ranks idle; then, where the ring crosses
nodes, every rank at once sends as much to the next rank and receives from the previous
(``ring_step``: one ring-attention step, every node's link and the host's cores busy as
in the strategies) and an all-to-all over every rank (Ulysses' collective: each rank's
``--mib`` MiB in equal parts to every rank, many flows on each node's link); each
``REPEATS`` times, the slowest rank's time. Then each again, back to back for
``--cpu-seconds`` (``CPU_SECONDS``), for the host CPU it takes (``/proc/stat``: every
node's ranks and the kernel's work on their packets; the cost model charges it beside
the kernels, which share the same cores). Rank 0 writes each transfer's median seconds
and every repeat, its host CPU seconds per call, the bytes and every rank's hostname and
node to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .cluster import probe_all_to_all_elements

__all__ = ["REPEATS", "main", "timed"]

CPU_SECONDS = 0.5
"""Seconds of back-to-back calls over which a transfer's host CPU is read (``/proc/stat``
counts in 10 ms ticks)."""

REPEATS = 5
"""Times each transfer is made; the probe reports their median (a typical rate over the
run, which the strategies see, not the best one a quiet moment gives)."""


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(transfer, repeats: int = REPEATS) -> list[float]:
    """The slowest rank's seconds of ``transfer()`` (every rank calls it, after a barrier),
    each of ``repeats`` times."""
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        transfer()
        out.append(_slowest(time.perf_counter() - t0))
    return out


def host_busy_seconds() -> float:
    """CPU seconds the host's cores have been busy since boot (``/proc/stat``'s first line:
    user, nice, system, irq, softirq; not per namespace, so every emulated node's ranks and
    the kernel's work on their packets)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def host_cpu_per_call(transfer, calls: int, background: float = 0.0) -> float:
    """The host's busy CPU seconds per ``transfer()``, made ``calls`` times back to back on
    every rank, less ``background`` busy seconds per second; read on this rank, which must
    take part in every call (rank 0: it does in every transfer of the probe)."""
    dist.barrier()
    b0, t0 = host_busy_seconds(), time.perf_counter()
    for _ in range(calls):
        transfer()
    dist.barrier()  # every rank's last call done
    busy, wall = host_busy_seconds() - b0, time.perf_counter() - t0
    return max(busy - background * wall, 0.0) / calls


def _exchange(to: int, frm: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Send ``x`` to rank ``to`` and receive ``y`` from rank ``frm`` at once, the receive
    posted first."""
    ops = [dist.P2POp(dist.irecv, y, frm), dist.P2POp(dist.isend, x, to)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def _transfers(
    rank: int, world: int, per_node: int, nbytes: int, cpu_seconds: float = CPU_SECONDS
) -> tuple[dict, dict]:
    """Each transfer's times (``timed``): the pairs alone (rank 0 with rank 1 inside its
    node, with node 1's first rank between nodes; the other ranks idle), then where the
    ring crosses nodes every rank's ring step at once and an all-to-all over every rank;
    and the host CPU seconds each takes (``host_cpu_per_call``)."""
    x = torch.zeros(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    pairs = {}
    if per_node > 1:
        pairs["intra_node"] = 1
    if world > per_node:
        pairs["inter_node"] = per_node
    transfers = {}
    for name, other in pairs.items():
        peer = {0: other, other: 0}.get(rank)
        transfers[name] = lambda p=peer: p is None or _exchange(p, p, x, y)
    if world > per_node:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        n = probe_all_to_all_elements(nbytes, world)
        a, b = torch.zeros(n), torch.empty(n)
        transfers["ring_step"] = lambda: _exchange(nxt, prv, x, y)
        transfers["all_to_all"] = lambda: dist.all_to_all_single(b, a)
    times = {name: timed(fn) for name, fn in transfers.items()}
    # the host CPU each transfer takes (the kernel's work on its packets, gloo's threads),
    # over cpu_seconds of calls each, less the background of ranks waiting in a barrier
    background = host_cpu_per_call(lambda: rank or time.sleep(cpu_seconds), 1) / cpu_seconds
    cpu = {
        name: host_cpu_per_call(
            fn, max(3, math.ceil(cpu_seconds / statistics.median(times[name]))), background
        )
        for name, fn in transfers.items()
    }
    cores = len(os.sched_getaffinity(0))  # the cores the ranks may run on
    return times, {"per_call_s": cpu, "background_per_s": background, "cores": cores}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mib", type=float, default=2.0)
    p.add_argument("--cpu-seconds", type=float, default=CPU_SECONDS)
    args = p.parse_args(argv)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world, per_node = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
        nbytes = int(args.mib * 2**20)
        times, cpu = _transfers(rank, world, per_node, nbytes, args.cpu_seconds)
        hosts: list = [None] * world
        dist.all_gather_object(
            hosts, (socket.gethostname(), int(os.environ.get("STARTRAIL_EMULATED_NODE", -1)))
        )
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "bytes": nbytes,
                        "seconds": {k: statistics.median(v) for k, v in times.items()},
                        "repeats": times,
                        "host_cpu": cpu,
                        "hosts": hosts,
                    },
                    f,
                )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
