"""Each collective alone on an emulated cluster, against the cost model's term for it.

Measure (every rank, inside the emulation; rank 0 writes OUT.json):

    python -m startrail_megatron.emulate --emulate 2x4 --inter-node 200mbit -- \
        python scripts/emulated_collectives.py measure OUT.json

times a gloo all-gather (``all_gather_into_tensor``), an all-to-all
(``all_to_all_single``) and a reduce-scatter (``reduce_scatter_tensor``: on gloo an
all-reduce of the whole input) over all ranks, 2 MiB per rank (the reduce-scatter: 2 MiB
out of each rank's world x 2 MiB), best of 3 (slowest rank).

Compare with the model of the same emulated cluster (the links and calibration of a
``startrail-bench --emulate`` report of that topology and rate):

    python scripts/emulated_collectives.py compare OUT.json REPORT.json

prints each collective's measured seconds, the model's (``planner.links.collective`` /
``all_to_all``) and their ratio (docs/performance.md section 13).
"""

from __future__ import annotations

import argparse
import json

MIB = 2**20


def measure(out_path: str, mib: float = 2.0, repeats: int = 3) -> None:
    import torch
    import torch.distributed as dist

    from startrail_megatron.emulate.probe import timed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        n = int(mib * MIB) // 4 // world * world  # elements per rank, splits over the ranks
        x, gathered = torch.zeros(n), torch.empty(world * n)
        y, swapped = torch.zeros(n), torch.empty(n)
        whole, chunk = torch.zeros(world * n), torch.empty(n)
        ops = {
            "all_gather": lambda: dist.all_gather_into_tensor(gathered, x),
            "all_to_all": lambda: dist.all_to_all_single(swapped, y),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(chunk, whole),
        }
        seconds = {name: min(timed(fn, repeats)) for name, fn in ops.items()}  # best of
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump({"bytes_per_rank": 4 * n, "world": world, "seconds": seconds}, f)
    finally:
        dist.destroy_process_group()


def compare(measured_path: str, report_path: str) -> list[str]:
    from startrail_megatron.planner.cli import load_cluster
    from startrail_megatron.planner.links import all_to_all, collective, reduce_scatter_extra

    with open(measured_path) as f:
        m = json.load(f)
    cl = load_cluster(report_path)  # the report's emulated cluster, as startrail-plan loads it
    world = cl.num_nodes * cl.gpus_per_node
    if world != m["world"]:
        raise SystemExit(f"{report_path}: {world} ranks, {measured_path}: {m['world']}")
    w, nb = m["world"], m["bytes_per_rank"]
    everyone = [list(range(w))]
    model = {
        "all_gather": collective(cl, everyone, (w - 1) * nb, 1),
        "all_to_all": all_to_all(cl, w, (w - 1) * nb // w, 1),
        # as planner.times charges the peers' reduce-scatters (the ledger's volume)
        "reduce_scatter": collective(cl, everyone, (w - 1) * nb, 1)
        + reduce_scatter_extra(cl, everyone, (w - 1) * nb),
    }
    return [  # the collectives measured (files before the reduce-scatter have two)
        f"{name}: measured {m['seconds'][name]:.3f} s, model {model[name]:.3f} s, "
        f"model / measured {model[name] / m['seconds'][name]:.2f}"
        for name in model
        if name in m["seconds"]
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("measure").add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("measured")
    c.add_argument("report")
    args = p.parse_args(argv)
    if args.cmd == "measure":
        measure(args.out)
    else:
        print("\n".join(compare(args.measured, args.report)))


if __name__ == "__main__":
    main()
