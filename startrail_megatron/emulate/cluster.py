"""An emulated multi-node cluster on one host: network namespaces, veth pairs and tbf.

Note [the emulated cluster]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``NODES x RANKS``: one network namespace per node, each joined by a veth pair to a bridge
that lives in a namespace of its own (the switch), so nothing is added to the host's own
network namespace. Both directions of each node's link are rate-limited with ``tc ...
tbf`` (the node's end shapes what it sends, the switch's end what it receives); the
queue is sized with ``limit`` (16 MB), not ``latency``, which drops packets and stalls
TCP at these rates. The ranks of a node reach each other through the node's own stack
(its address is local, so the kernel routes it over ``lo``): unlimited, or ``--intra-node
RATE`` with a tbf on that ``lo``. Each rank runs inside its node's namespace under ``unshare
--uts`` with its node's own hostname (the code counts hosts by hostname) and
``GLOO_SOCKET_IFNAME=eth0``; rank r is on node ``r // RANKS``. Everything the run created
(namespaces, and with them the links, the bridge and the queues; the rank processes) is
removed on exit, also when a rank fails or the parent is interrupted.

What it does not model: latency (netem is not available; tbf adds only queueing delay),
several NICs per node, and the GPUs' compute: every rank shares the host's cores.
Needs root, ``ip`` and ``tc`` (iproute2), and ``unshare`` (util-linux).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "EmulatedCluster",
    "EmulationSpec",
    "check_can_emulate",
    "leftovers",
    "parse_rate",
    "parse_topology",
]

SUBNET = "10.77.0"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str, name: str = "rate") -> float:
    """``"200mbit"`` -> bits per second; ``ValueError`` naming ``name`` and the allowed
    forms otherwise (tc's ``mbps`` means megabytes, so only ``kbit``, ``mbit``, ``gbit``)."""
    m = _RATE.match(str(text).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"{name} {text!r} must be a positive number with kbit, mbit or gbit (e.g. 200mbit)"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_topology(text: str, name: str = "--emulate") -> tuple[int, int]:
    """``"4x2"`` -> (nodes, ranks per node); ``ValueError`` naming ``name`` otherwise."""
    m = re.match(r"^(\d+)x(\d+)$", str(text).strip().lower())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"{name} {text!r} must be NODESxRANKS with both >= 1 (e.g. 4x2)")
    nodes, ranks = int(m.group(1)), int(m.group(2))
    if nodes > 200:
        raise ValueError(f"{name} {text!r}: at most 200 nodes")
    return nodes, ranks


def probe_all_to_all_elements(nbytes: int, world: int) -> int:
    """The float32 elements each rank sends in the link probe's all-to-all: ``nbytes``
    rounded down to ``world`` equal parts (``probe.py`` sends them, the benchmark's
    cluster description times them)."""
    return nbytes // 4 // world * world


@dataclass(frozen=True)
class EmulationSpec:
    """What to emulate: ``nodes`` x ``ranks_per_node`` ranks, each node's link limited to
    ``inter_bps`` bits/s in each direction, and optionally ``intra_bps`` inside a node."""

    nodes: int
    ranks_per_node: int
    inter_bps: float
    intra_bps: float | None = None

    @classmethod
    def parse(cls, topology: str, inter: str, intra: str | None = None) -> EmulationSpec:
        nodes, ranks = parse_topology(topology)
        return cls(
            nodes,
            ranks,
            parse_rate(inter, "--inter-node"),
            None if intra is None else parse_rate(intra, "--intra-node"),
        )

    @classmethod
    def from_flags(cls, parser, topology: str, inter: str, intra: str | None) -> EmulationSpec:
        """``parse`` and ``check_can_emulate`` for a command line: ``parser.error`` (exit 2,
        the message naming the flag or what is missing) where either fails."""
        try:
            spec = cls.parse(topology, inter, intra)
            check_can_emulate()
        except (ValueError, RuntimeError) as e:
            parser.error(str(e))
        return spec

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def as_dict(self) -> dict:
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "inter_node_bits_per_s": self.inter_bps,
            "intra_node_bits_per_s": self.intra_bps,
        }


def _tc_rate(bps: float) -> str:
    return f"{int(bps)}bit"


def _burst(bps: float) -> int:
    """tbf's bucket: 1 ms at the rate, at least 64 KiB (tbf's watchdog is a high-resolution
    timer, so the rate is reached with it). A bigger bucket lets a transfer that starts
    after a pause send that much at the host's speed: at 500 Mbit/s a 10 ms bucket (625
    KB) made a 2 MiB exchange run at 650 Mbit/s, and a link the model cannot describe
    with one rate."""
    return max(64 * 1024, int(bps / 8 / 1000))


def check_can_emulate() -> None:
    """``RuntimeError`` naming what is missing: root, ``ip``, ``tc``, ``unshare``."""
    if os.geteuid() != 0:
        raise RuntimeError(
            "the emulated cluster needs root (network namespaces, veth links, tc); run as root "
            "or drop --emulate"
        )
    missing = [c for c in ("ip", "tc", "unshare") if shutil.which(c) is None]
    if missing:
        raise RuntimeError(
            f"the emulated cluster needs {missing} (iproute2, util-linux) on the PATH"
        )


class EmulatedCluster:
    """Build the cluster of ``spec`` (Note [the emulated cluster]); a context manager.

    ``with EmulatedCluster(spec) as cl: cl.run(cmd, ...)`` builds on entry and removes
    everything on exit. ``tag`` prefixes every name it creates (default: from the pid).
    """

    def __init__(self, spec: EmulationSpec, tag: str | None = None):
        if tag is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,39}", tag):
            raise ValueError(
                f"--tag {tag!r}: it names namespaces and hostnames, so letters, digits and "
                "'-' only, starting with a letter or digit, at most 40 characters"
            )
        self.spec = spec
        self.tag = tag or f"st{os.getpid() % 100000}"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._old_handlers: dict = {}

    # ---- names ---------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def node_ns(self, node: int) -> str:
        return f"{self.tag}-n{node}"

    def hostname(self, node: int) -> str:
        return f"{self.tag}-node{node}"

    # ---- build and remove ----------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.build()
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _ip(self, *args: str) -> None:
        _run(["ip", *args])

    def _in(self, ns: str, *args: str) -> None:
        _run(["ip", "netns", "exec", ns, *args])

    def build(self) -> None:
        """Create the switch, the nodes, their links and queues; on any failure remove
        what was made and raise."""
        check_can_emulate()
        atexit.register(self.teardown)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise

    def _build(self) -> None:
        sp, sw = self.spec, self.switch
        self._add_ns(sw)
        self._ip("-n", sw, "link", "set", "lo", "up")
        self._ip("-n", sw, "link", "add", "br0", "type", "bridge")
        self._ip("-n", sw, "link", "set", "br0", "up")
        rate, burst = _tc_rate(sp.inter_bps), str(_burst(sp.inter_bps))
        for k in range(sp.nodes):
            ns, port = self.node_ns(k), f"p{k}"
            self._add_ns(ns)
            self._ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)  # fmt: skip
            self._ip("-n", sw, "link", "set", port, "master", "br0")
            self._ip("-n", sw, "link", "set", port, "up")
            self._ip("-n", ns, "addr", "add", f"{sp.address(k)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            for where, dev in ((ns, "eth0"), (sw, port)):  # what the node sends / receives
                self._in(where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                         "burst", burst, "limit", "16mb")  # fmt: skip
            if sp.intra_bps is not None:
                ir = sp.intra_bps
                self._in(ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                         _tc_rate(ir), "burst", str(_burst(ir)), "limit", "16mb")  # fmt: skip

    def _add_ns(self, ns: str) -> None:
        self._ip("netns", "add", ns)
        self.namespaces.append(ns)

    def _on_signal(self, signum, frame) -> None:
        self.teardown()
        raise SystemExit(128 + signum)

    def teardown(self) -> None:
        """Kill the rank processes and delete every namespace made (their links, the
        bridge and the queues go with them). Safe to call more than once."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        for ns in reversed(self.namespaces):
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout.split()
            for pid in pids:  # anything still inside (a rank's child)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.namespaces = []
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}
        atexit.unregister(self.teardown)

    # ---- ranks -----------------------------------------------------------------------
    def rank_env(self, rank: int, port: int, base: dict | None = None) -> dict:
        """The environment of ``rank``: torchrun's variables, rendezvous at node 0, and, as
        torchrun sets it, ``OMP_NUM_THREADS=1`` unless given: every rank of every node
        shares the host's cores, and ranks that each start a thread per core spin against
        each other (a Megatron training step at CP = 8 took 6 - 8 s instead of 1)."""
        sp = self.spec
        env = dict(os.environ if base is None else base)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(sp.world_size),
            LOCAL_RANK=str(rank % sp.ranks_per_node),
            LOCAL_WORLD_SIZE=str(sp.ranks_per_node),
            MASTER_ADDR=sp.address(0),
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="eth0",
            STARTRAIL_EMULATED_NODE=str(sp.node_of(rank)),
        )
        return env

    def start(self, cmd: Sequence[str], port: int = 29555, env: dict | None = None) -> None:
        """Start ``cmd`` once per rank, inside its node (its namespace and hostname)."""
        for r in range(self.spec.world_size):
            k = self.spec.node_of(r)
            wrapped = ["ip", "netns", "exec", self.node_ns(k), "unshare", "--uts", "sh", "-c",
                       'hostname "$0" && exec "$@"', self.hostname(k), *cmd]  # fmt: skip
            self.procs.append(
                subprocess.Popen(wrapped, env=self.rank_env(r, port, env), start_new_session=True)
            )

    FAIL_GRACE_S = 2.0
    """After a rank fails, how long the others may still finish or print their own error
    before they are stopped (a rank waiting on the dead one waits for its timeout)."""

    def wait(self, timeout: float) -> None:
        """Wait for every rank; ``RuntimeError`` naming the first rank that failed (the
        others are stopped ``FAIL_GRACE_S`` later) or the ranks still running at ``timeout``."""
        deadline = time.monotonic() + timeout
        failed_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed_at is None:
                failed_at = time.monotonic()
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() > failed_at + self.FAIL_GRACE_S:
                break
            if time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise RuntimeError(
                    f"emulated ranks {running} still running after {timeout:.0f}s (hang)"
                )
            time.sleep(0.05)
        if bad:
            r, c = bad[0]
            raise RuntimeError(
                f"emulated rank {r} (node {self.spec.node_of(r)}) exited with code {c}"
            )

    def run(self, cmd: Sequence[str], timeout: float, port: int = 29555, env=None) -> None:
        """``start`` then ``wait``."""
        self.start(cmd, port, env)
        self.wait(timeout)


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")


def leftovers(tag: str) -> list[str]:
    """Network namespaces whose name starts with ``tag`` (the tests' check that nothing
    was left behind)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [ln.split()[0] for ln in out.stdout.splitlines() if ln.startswith(tag)]
