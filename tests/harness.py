"""Multi-rank test harness: a pool of forked gloo ranks, reused across tests.

``get_pool(world_size).run(fn, *args)`` runs the module-level function
``fn(rank, world_size, *args)`` on every rank and returns the list of its
return values (rank order). Each task has a deadline; on a timeout or any
rank's exception, every rank is killed, the pool is discarded, and the error
is raised with each rank's traceback, root cause first (a rank that failed
because a peer died says "connection closed"/"timed out" and is listed last).

Design (measured on the 2-core CI machines): fork (0.1 s for 4 ranks, against
~3 s to spawn), with ``torch.set_num_threads(1)`` first thing in the child (a
forked child deadlocks on its first multithreaded op once the parent ran one);
file:// rendezvous in a temp dir (no port races); a gloo timeout below the task
deadline so a hung collective fails by itself too. One pool per size is kept
while the live ranks stay within ``MAX_LIVE_RANKS`` (a task runs on one pool at a
time; the others wait idle), so tests that alternate sizes reuse ranks; a pool whose
ranks hold too many threads (process groups not destroyed) is closed (``get_pool``). The
heavy third-party modules the tests import inside their rank functions (megatron-core,
DeepSpeed, transformers) are imported once in the parent before the first fork
(``PRELOAD``), so that each new pool's ranks inherit them instead of importing them again;
so are the core's modules, which the package root resolves only on first use. The parent
then freezes its objects out of the collector before each fork (``gc.freeze``: a rank's
collection walked and copied them all) and keeps DeepSpeed from building its shm op in the
ranks (``_skip_deepspeed_shm_op``). Each rank's gloo groups share one transport device
(``_share_one_gloo_device``), whose event-loop thread runs under ``SCHED_IDLE``
(``_idle_gloo_loop``: it spun on pairs its rank held locked, ~0.45 of a core).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from datetime import timedelta

DEFAULT_TIMEOUT = float(os.environ.get("STARTRAIL_TEST_TIMEOUT", "120"))
_SECONDARY = (
    "connection closed",
    "timed out",
    "timeout",
    "connection reset",
    "broken pipe",
    "peer",
)


PRELOAD = (
    "startrail_megatron.attention",  # the package root resolves these on first use:
    "startrail_megatron.peers",  # imported here once, not again in every forked rank
    "startrail_megatron.joint",
    "startrail_megatron.one_process",
    "megatron.core.models.gpt",
    "megatron.core.datasets.gpt_dataset",
    # the trainer's NullTokenizer: its package imports transformers' tokenizers, whose lazy
    # module scans every model family on first use (~1.5 s per new rank without this)
    "megatron.core.tokenizers.text.libraries.null_tokenizer",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "deepspeed",
    "transformers",
    # imported lazily inside the ranks' tests: here once, not in each rank of each new pool
    # (~18 CPU s of the 3.11 lane's ranks, summed over the modules they imported)
    "startrail_megatron.megatron.training",
    "startrail_megatron.deepspeed.megatron_gpt",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.helpers",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.models.hybrid.hybrid_model",  # our hooks wrap its model on 0.19 (not in 0.16)
    "deepspeed.sequence.layer",  # DeepSpeed's engine, on first use
    "deepspeed.module_inject.auto_ep_config",
    "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "transformers.models.gemma2.modeling_gemma2",  # the model families the tests build
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.gpt_oss.modeling_gpt_oss",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.qwen2.modeling_qwen2",
    "multiprocessing.managers",  # megatron-core's checkpoint writer
)


_preloaded = False


class MultiRankError(AssertionError):
    pass


def _preload() -> None:
    """Import ``PRELOAD`` here, once; one that fails to import is left to the test that
    needs it, which then fails on its own import."""
    global _preloaded
    if _preloaded or os.environ.get("STARTRAIL_TEST_PRELOAD") == "0":  # 0: measure without
        return
    _preloaded = True
    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception:
            pass
    _skip_deepspeed_shm_op()


def _skip_deepspeed_shm_op() -> None:
    """DeepSpeed's CPU backend JIT-builds its shared-memory op when a rank initializes
    ``deepspeed.comm``; the op serves only ``inference_all_reduce`` (no test calls it: every
    collective here goes through ``torch.distributed``). The build's command lines name the
    venv's path, so a fresh clone rebuilds it (35 - 45 s of both cores per test lane).
    Marked incompatible here, in the parent every rank is forked from, DeepSpeed falls back
    to ``torch.distributed`` as it does on a machine without the op. STARTRAIL_TEST_DS_SHM=1
    builds and loads it as users' CPU runs do."""
    if os.environ.get("STARTRAIL_TEST_DS_SHM") == "1" or "deepspeed" not in sys.modules:
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _children(pid: int) -> list:
    """The live descendants of ``pid`` (psutil, where installed: megatron-core needs it)."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # no psutil, or the process is gone
        return []


def _exit(code: int) -> None:
    """End a pool rank without leaving its own children behind: ``os._exit`` runs no
    finalizers, so a multiprocessing child the rank started (megatron-core 0.19's
    checkpoint writer starts a ``Manager`` server process per process) would live on as
    an orphan holding its memory."""
    for child in mp.active_children():
        child.kill()
        child.join(1)
    os._exit(code)


def _share_one_gloo_device() -> None:
    """Every gloo process group this rank creates from here on uses one transport device.

    torch gives each gloo group a device of its own, and each device an event-loop thread
    that wakes every 10 ms even while its group is idle: a rank holding megatron-core's
    ~60 groups spent 7.3% of a core doing nothing (8 such ranks: 0.6 of the 2 CI cores;
    ``perf`` put 18% of a megatron test file's samples in those threads). With one shared
    device (gloo runs many contexts on one device) the same rank idles at 0%. The groups,
    their ranks, timeouts and collectives are as before; only the rank's own socket
    listener and loop thread are shared. STARTRAIL_TEST_GLOO_SHARED_DEVICE=0: a device per
    group, as torch does."""
    if os.environ.get("STARTRAIL_TEST_GLOO_SHARED_DEVICE") == "0":
        return
    import torch.distributed.distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo
    devices = []

    class _GlooOnSharedDevice(gloo):  # a subclass: torch's isinstance checks still hold
        def __init__(self, store, rank, size, timeout=c10d.default_pg_timeout):
            if not devices:  # as torch's own constructor picks them, once
                iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
                devices.extend(
                    [gloo.create_device(interface=i) for i in iface.split(",")]
                    if len(iface) > 1
                    else [gloo.create_default_device()]
                )
            options = gloo._Options()
            options._timeout = timeout
            options._devices = list(devices)
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = _GlooOnSharedDevice


def gloo_loop_threads() -> list[int]:
    """The thread ids of this process's gloo event loops (threads named ``gloo_tcp_loop``)."""
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    tids.append(int(tid))
        except OSError:  # the thread is gone
            pass
    return tids


def _idle_gloo_loop() -> None:
    """The rank's gloo event-loop thread (``gloo_tcp_loop``) runs under ``SCHED_IDLE``.

    That thread reads each socket when epoll says it is readable, but first try-locks the
    pair; while the rank's own thread holds the pair's lock (it posts a receive, sends a
    notice or a payload: a ``writev`` into loopback TCP, which runs the peer's receive path
    too) the loop skips the pair and calls ``epoll_wait`` again at once, and the socket is
    still readable: it spins. On test_attention's P = 16 cases it made 6.2 million
    ``epoll_wait`` calls for 0.4 million reads (~0.45 of a core, taken from the ranks'
    work on the 2 CI cores). Under ``SCHED_IDLE`` the thread yields the core to any
    runnable rank thread, the lock's holder included: 0.14 million calls for the same
    reads, and the cases took 30 - 34 s instead of 35 - 40. The thread still runs whenever
    a core has nothing else to do, as it does when its rank waits for the data; messages,
    collectives and timeouts are unchanged. With STARTRAIL_TEST_GLOO_SHARED_DEVICE=0 only
    the first group's loop is made idle; STARTRAIL_TEST_GLOO_LOOP_IDLE=0 leaves it as torch
    starts it."""
    if os.environ.get("STARTRAIL_TEST_GLOO_LOOP_IDLE") == "0" or not hasattr(os, "SCHED_IDLE"):
        return
    for tid in gloo_loop_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # the thread is gone
            pass


def _worker(rank: int, world: int, init_file: str, conn, pg_timeout: float) -> None:
    for other in _POOLS.values():  # the parent's ends of the other live pools' pipes: a
        for c in other.conns:  # rank holding them would keep those ranks from seeing EOF
            c.close()
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    _share_one_gloo_device()

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        _exit(1)
    _idle_gloo_loop()  # after the first group: its device's loop thread exists now
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            _exit(0)
        if msg is None:
            _exit(0)
        fn, args = msg
        try:
            conn.send(("ok", fn(rank, world, *args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


class RankPool:
    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT):
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="startrail_pool_")
        _preload()
        # Everything the parent holds now (torch, megatron-core, DeepSpeed, transformers: a
        # few million objects) moves to the collector's permanent generation: a rank's
        # collection (``gc.collect()`` in a test, or an automatic full one) no longer walks
        # them, nor writes their headers, which copied every page they lie on into the rank.
        gc.freeze()
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(r, world_size, os.path.join(self.tmp, "rdv"), child, timeout * 0.8),
                daemon=False,  # ranks may start processes (megatron's checkpoint writer does)
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(timeout, "start-up")

    def _collect(self, timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        results: dict[int, tuple] = {}
        first_err: float | None = None
        while len(results) < self.world_size:
            pending = {c: r for r, c in enumerate(self.conns) if r not in results}
            # woken by the first rank that answers (or closes its end by dying), else every
            # 0.1 s to look at the deadline and at ranks that died without closing it
            for c in mp_connection.wait(list(pending), timeout=0.1):
                r = pending[c]
                try:
                    results[r] = c.recv()
                except EOFError:
                    results[r] = ("err", f"rank {r} died (exit code {self.procs[r].exitcode})")
            for c, r in pending.items():
                if r not in results and not self.procs[r].is_alive() and not c.poll():
                    results[r] = ("err", f"rank {r} died (exit code {self.procs[r].exitcode})")
            if first_err is None and any(v[0] == "err" for v in results.values()):
                first_err = time.monotonic()
            # After a failure, give the others a moment to report theirs, then stop.
            if first_err is not None and time.monotonic() > first_err + 5:
                break
            if time.monotonic() > deadline:
                break
        errors = {r: v[1] for r, v in results.items() if v[0] == "err"}
        missing = [r for r in range(self.world_size) if r not in results]
        if errors or missing:
            self.close()
            raise MultiRankError(self._report(what, errors, missing, timeout))
        return [results[r][1] for r in range(self.world_size)]

    @staticmethod
    def _report(what, errors, missing, timeout) -> str:
        def secondary(tb: str) -> bool:
            last = tb.strip().splitlines()[-1].lower() if tb.strip() else ""
            return any(s in last for s in _SECONDARY)

        order = sorted(errors, key=lambda r: (secondary(errors[r]), r))
        lines = [f"multi-rank {what} failed"]
        if missing:
            lines.append(f"ranks {missing} did not answer within {timeout:.0f}s (hang or deadlock)")
        for r in order:
            lines.append(f"--- rank {r} ---\n{errors[r]}")
        return "\n".join(lines)

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT) -> list:
        for c in self.conns:
            c.send((fn, args))
        return self._collect(timeout, getattr(fn, "__name__", "task"))

    def threads(self) -> int:
        """The most threads any rank of the pool holds (psutil, as ``_children``; 0 without
        it, or for a rank that is gone)."""
        try:
            import psutil
        except ImportError:
            return 0
        most = 0
        for p in self.procs:
            try:
                most = max(most, psutil.Process(p.pid).num_threads())
            except psutil.Error:
                pass
        return most

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(0.5)
            if p.is_alive():  # a hung rank: its own children too, or they outlive it
                for child in _children(p.pid):
                    child.kill()
                p.kill()
                p.join(1)
        self.procs, self.conns = [], []
        shutil.rmtree(self.tmp, ignore_errors=True)
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]


# The live pools, least recently used first. Tests alternate sizes (a megatron test runs its
# one-rank reference, then its CP ranks; parametrized cases go 4, 8, 16, 4, ...): a pool is
# kept for each size while the live ranks stay within MAX_LIVE_RANKS, so that a size used
# again reuses its ranks instead of forking new ones.
#
# A gloo process group keeps its threads and sockets until it is destroyed. Megatron-core's
# ``destroy_model_parallel`` only drops its own references to its groups (torch keeps them:
# ~50 threads per initialization at 2 ranks, when each group had a device of its own); a
# pool kept through the suite reached ~930 threads per rank and lane 1 took 890 s instead of
# 355, most of it in the groups' idle event loops. With one device per rank
# (``_share_one_gloo_device``) an idle group costs no CPU, but each still holds two threads
# and a socket per peer (a developer's default limit is 1,024 open files). So a pool is left
# waiting only while its ranks hold at most IDLE_RANK_THREADS threads each (it is closed
# when the next task goes to another pool), and is reused only while they hold at most
# MAX_RANK_THREADS (tried at 200 / 400 on the megatron and DeepSpeed files: within the
# noise; at 600 / 3,000 a rank held 723 open files).
_POOLS: OrderedDict[int, RankPool] = OrderedDict()
MAX_LIVE_RANKS = int(os.environ.get("STARTRAIL_TEST_MAX_RANKS", "32"))
IDLE_RANK_THREADS = 32
MAX_RANK_THREADS = 200


def get_pool(world_size: int) -> RankPool:
    """The live pool of this size, or a fresh one. Closes the other pools whose ranks hold more
    than ``IDLE_RANK_THREADS`` threads, this size's if they hold more than
    ``MAX_RANK_THREADS``, and the least recently used while the live ranks would exceed
    ``MAX_LIVE_RANKS``."""
    for size, pool in list(_POOLS.items()):
        limit = MAX_RANK_THREADS if size == world_size else IDLE_RANK_THREADS
        if pool.threads() > limit or not all(p.is_alive() for p in pool.procs):
            pool.close()
    pool = _POOLS.get(world_size)
    if pool is not None:
        _POOLS.move_to_end(world_size)
        return pool
    while _POOLS and sum(_POOLS) + world_size > MAX_LIVE_RANKS:
        next(iter(_POOLS.values())).close()
    pool = RankPool(world_size)
    _POOLS[world_size] = pool
    return pool


def run_ranks(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT) -> list:
    return get_pool(world_size).run(fn, *args, timeout=timeout)


def shutdown() -> None:
    """Close every live pool."""
    for pool in list(_POOLS.values()):
        pool.close()
    gc.unfreeze()  # the parent's own teardown collects them as usual (nanobind checks)
