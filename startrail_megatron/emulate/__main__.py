"""Run any torchrun-style command on an emulated multi-node cluster (root).

    python -m startrail_megatron.emulate --emulate 4x2 --inter-node 200mbit -- \\
        python -m startrail_megatron.pretrain_gpt --context-parallel-size 8 ...

Builds the cluster (``cluster.py``'s Note [the emulated cluster]), starts the command once
per rank inside its node with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` at node 0, ...), waits, and removes everything, also on
failure or Ctrl-C. ``--probe`` first times one exchange inside a node, one between
nodes and a ring step of every rank at once (``probe.py``), and prints the rates. Exit
status: 0, or 1 naming the rank that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from .cluster import EmulatedCluster, EmulationSpec


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, cmd = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m startrail_megatron.emulate", description=__doc__.splitlines()[0]
    )
    p.add_argument("--emulate", metavar="NODESxRANKS", required=True)
    p.add_argument("--inter-node", metavar="RATE", default="200mbit")
    p.add_argument("--intra-node", metavar="RATE", default=None)
    p.add_argument("--probe", action="store_true", help="time the links first")
    p.add_argument("--timeout", type=float, default=3600, help="whole run, s")
    p.add_argument("--port", type=int, default=29555)
    p.add_argument("--tag", default=None, help="prefix of every name made (default: st<pid>)")
    args = p.parse_args(argv)
    if not cmd:
        p.error("give the command to run after --")
    spec = EmulationSpec.from_flags(p, args.emulate, args.inter_node, args.intra_node)
    try:
        cluster = EmulatedCluster(spec, tag=args.tag)
    except ValueError as e:
        p.error(str(e))
    with cluster as cl:
        try:
            if args.probe:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "probe.json")
                    probe = [sys.executable, "-m", "startrail_megatron.emulate.probe", out]
                    cl.run(probe, timeout=600, port=args.port)
                    with open(out) as f:
                        res = json.load(f)
                rates = {
                    k: f"{8 * res['bytes'] / v / 1e6:.0f} Mbit/s" for k, v in res["seconds"].items()
                }
                print(f"emulated {args.emulate}: probe {rates}", flush=True)
            cl.run(cmd, timeout=args.timeout, port=args.port + 1)
        except RuntimeError as e:
            print(f"emulate: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
