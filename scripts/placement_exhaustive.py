"""How far ``node_map``'s search is from the best map the cost model has, by pricing every
assignment of StarTrail's logical ranks to the nodes (``planner.placement.exhaustive_map``).

    python scripts/placement_exhaustive.py REPORT.json [REPORT.json ...]
    python scripts/placement_exhaustive.py --preset h100-ib --topology 3x4

A report is a ``startrail-bench --emulate`` run (``scripts/placement_campaign.sh``): its
cluster as the model saw it (the probe's links and the run's kernels, timed kernels at
the run's rate). A preset is priced at ``AUTO_SHAPE``, what ``placement="auto"`` prices.
Prints one markdown row per input: the maps priced, ring's time, and the team placement,
ring placement, search and best map over ring's. Where there are too many assignments
(3 x 8: 1.6e9) it prices none, or with ``--anneal N`` runs a simulated annealing of N
swaps of two ranks from the search's map (seeded: the same on every
run; a better map it finds bounds the search from above, none proves it optimal).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from startrail_megatron.bench.emulated import _shape
from startrail_megatron.bench.timed_kernel import timed_cluster
from startrail_megatron.planner.cli import load_cluster
from startrail_megatron.planner.cluster import CLUSTER_PRESETS
from startrail_megatron.planner.placement import (
    AUTO_SHAPE,
    exhaustive_map,
    map_cost,
    node_map,
)
from startrail_megatron.planner.shape import AttnShape
from startrail_megatron.planner.strategies import Strategy


def anneal(cluster, shape: AttnShape, team_size: int, start, swaps: int, seed: int = 0):
    """(map, predicted seconds): the best map a simulated annealing of ``swaps`` swaps of
    two CP ranks meets, from ``start`` (the temperature falls linearly from 5 % of the
    start's time to 0). Swaps inside a node too: they change which chunks of the sequence
    a team holds, so its steps' causal work, which ``node_map`` does not search."""
    rng = random.Random(seed)
    m = list(start)
    p = len(m)
    cur = best = map_cost(cluster, shape, team_size, tuple(m))
    best_map = tuple(m)
    t0 = 0.05 * cur
    for k in range(swaps):
        i, j = rng.randrange(p), rng.randrange(p)
        m[i], m[j] = m[j], m[i]
        cost = map_cost(cluster, shape, team_size, tuple(m))
        temp = t0 * (1 - k / swaps) + 1e-15
        if cost < cur or rng.random() < math.exp((cur - cost) / temp):
            cur = cost
            if cost < best:
                best, best_map = cost, tuple(m)
        else:
            m[i], m[j] = m[j], m[i]
    return best_map, best


def row(
    label: str, cluster, shape: AttnShape, team_size: int, max_assignments: int, swaps: int = 0
) -> str:
    ring = Strategy("startrail", 1, "team")
    ring_s = sum(ring.spec.times(ring, cluster, shape))
    named = [map_cost(cluster, shape, team_size, pl) / ring_s for pl in ("team", "ring")]
    search_map, search_s = node_map(cluster, shape, team_size)
    t0 = time.perf_counter()
    try:
        best_map, best_s, count = exhaustive_map(
            cluster, shape, team_size, max_assignments=max_assignments
        )
    except ValueError as e:
        if not swaps:
            return f"| {label} | {e} | {ring_s * 1e3:.2f} | {named[0]:.3f} | {named[1]:.3f} | " \
                f"{search_s / ring_s:.3f} | - |"  # fmt: skip
        best_map, best_s = anneal(cluster, shape, team_size, search_map, swaps)
        took = time.perf_counter() - t0
        return (
            f"| {label} | annealing, {swaps} swaps ({took:.0f} s) | {ring_s * 1e3:.2f} | "
            f"{named[0]:.3f} | {named[1]:.3f} | {search_s / ring_s:.3f} | "
            f"{best_s / ring_s:.3f} `{list(best_map)}` |"
        )
    took = time.perf_counter() - t0
    return (
        f"| {label} | {count} ({took:.0f} s) | {ring_s * 1e3:.2f} | {named[0]:.3f} | "
        f"{named[1]:.3f} | {search_s / ring_s:.3f} | {best_s / ring_s:.3f} `{list(best_map)}` |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="*", help="startrail-bench --emulate reports")
    p.add_argument("--preset", default=None, help="a startrail-plan cluster preset")
    p.add_argument("--topology", default=None, metavar="NODESxRANKS", help="with --preset")
    p.add_argument("--team-size", type=int, default=2)
    p.add_argument("--max-assignments", type=int, default=20000)
    p.add_argument(
        "--anneal", type=int, default=0, metavar="N",
        help="where there are more assignments: N annealing swaps from the search's map",
    )  # fmt: skip
    args = p.parse_args(argv)
    if (args.preset is None) != (args.topology is None):
        p.error("--preset and --topology go together")
    if args.preset is not None and args.preset not in CLUSTER_PRESETS:
        p.error(f"--preset {args.preset!r}: one of {sorted(CLUSTER_PRESETS)}")
    if not args.reports and args.preset is None:
        p.error("give reports, or --preset and --topology")
    print(
        "| input | maps priced | ring (ms) | team / ring | ring placement / ring | "
        "search / ring | best map / ring |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in args.reports:
        with open(path) as f:
            rep = json.load(f)
        if "emulation" not in rep:
            raise SystemExit(f"{path}: not an emulated report (no 'emulation')")
        cluster = timed_cluster(load_cluster(path), rep["config"].get("timed_kernels_flops"))
        em = rep["emulation"]
        label = f"{em['nodes']} x {em['ranks_per_node']}, {path.rsplit('/', 1)[-1]}"
        shape = _shape(rep["config"])
        print(row(label, cluster, shape, args.team_size, args.max_assignments, args.anneal))
    if args.preset is not None:
        try:
            nodes, per = (int(x) for x in args.topology.lower().split("x"))
        except ValueError:
            p.error(f"--topology {args.topology!r}: NODESxRANKS, e.g. 3x4")
        cluster = CLUSTER_PRESETS[args.preset].with_(num_nodes=nodes, gpus_per_node=per)
        shape = AttnShape(nodes * per, **AUTO_SHAPE)
        label = f"{args.preset} {nodes} x {per}"
        print(row(label, cluster, shape, args.team_size, args.max_assignments, args.anneal))


if __name__ == "__main__":
    main()
