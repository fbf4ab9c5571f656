"""All CP ranks in one process: the StarTrail schedule on one device, comm as tensor moves.

``one_process_attention(q_shards, k_shards, v_shards, team_size)`` runs every
rank's forward (and, through autograd, backward) of ``attention.py`` on one
device, in one process, with no ``torch.distributed``: the team collectives
and sub-ring P2P exchanges become tensor copies between the ranks. It exists
to check and time the full algorithm with GPU kernels on one GPU
(``scripts/gpu_check.sh``), and outputs are bitwise those of a real
multi-rank run (``tests/test_one_process.py`` compares with gloo ranks).

Design: the algorithm is not duplicated. ``attention._forward`` /
``_backward`` run unchanged for each rank; only the two comm objects are
injected (``_Ctx(..., comms=...)``). Each rank runs in its own Python thread,
but the threads are coroutines: a driver hands a baton to one rank at a
time, in rank order, and a rank gives it back only when it must wait for a
message or a collective its peers have not posted yet. So exactly one rank
executes at any moment, the order is deterministic, and a rank's compute can
be timed by the segments it holds the baton outside communication
(``RankTimer``). Why threads rather than rewriting the schedule as generators:
the per-rank code keeps its straight-line form, shared with the multi-rank
path. The autograd graph is one node over all ranks (``_OneProcess``), so the
engine's per-device backward thread never blocks on a peer.

Messages: the k-th send from rank a to rank b is the k-th receive b posted
from a (MPI/NCCL ordering); a sent tensor is cloned, as a receive buffer
would be. Collectives gather the members' posts in member order. The
reduce-scatter adds the members' parts in the order gloo's ring algorithm
does (member m: m-1, m-2, ..., m last; measured on torch 2.13 for C = 3, 4),
so results are bitwise gloo's for every C; for C <= 2 any order is, since
a + b == b + a. NCCL may add in another order (ring or tree): against NCCL
ranks, C > 2 can differ in the last bit of the fp32 sums.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .attention import _backward, _forward, validate_inputs
from .comm import CommLedger, _nbytes
from .groups import StarTrailGroups
from .kernels import AttentionKernel, get_kernel
from .layout import Placement, StarTrailLayout

__all__ = ["RankTimer", "one_process_attention"]


class RankTimer:
    """Compute time of each rank, excluding its communication and waiting.

    On CUDA, events recorded on the current stream bound each segment (read
    after one synchronize in ``totals``); elsewhere ``time.perf_counter``.
    """

    def __init__(self, world_size: int, device: torch.device | str = "cpu"):
        self.world_size = world_size
        self.device = torch.device(device)
        self._open: dict[int, Any] = {}
        self._segments: list[list[tuple[Any, Any]]] = [[] for _ in range(world_size)]

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def resume(self, rank: int) -> None:
        self._open[rank] = self._mark()

    def pause(self, rank: int) -> None:
        start = self._open.pop(rank, None)
        if start is not None:
            self._segments[rank].append((start, self._mark()))

    def totals(self) -> list[float]:
        """Seconds of compute per rank since the last ``reset``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [sum(a.elapsed_time(b) for a, b in seg) / 1e3 for seg in self._segments]
        return [sum(b - a for a, b in seg) for seg in self._segments]

    def reset(self) -> None:
        self._open.clear()
        self._segments = [[] for _ in range(self.world_size)]


class _Aborted(BaseException):
    """Raised in a rank thread when the driver stops the run (a peer failed)."""


class _Baton:
    """Runs one callable per rank as cooperative threads: one at a time, rank order."""

    def __init__(self, world_size: int, device: torch.device, timer: RankTimer | None):
        self.n, self.device, self.timer = world_size, device, timer
        self._go = [threading.Semaphore(0) for _ in range(world_size)]
        self._parked = threading.Semaphore(0)
        self._aborting = False
        self.progress = 0

    def _pause(self, rank: int) -> None:
        if self.timer is not None:
            self.timer.pause(rank)

    def _resume(self, rank: int) -> None:
        if self.timer is not None:
            self.timer.resume(rank)

    def wait_until(self, rank: int, ready: Callable[[], bool]) -> None:
        """Called by rank ``rank`` (not timed): hand the baton back until ``ready()``."""
        while not ready():
            self._parked.release()
            self._go[rank].acquire()
            if self._aborting:
                raise _Aborted
        self.progress += 1

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        n = self.n
        results: list[Any] = [None] * n
        done = [False] * n
        errors: dict[int, BaseException] = {}
        threads_per_op = torch.get_num_threads()

        def body(r: int) -> None:
            self._go[r].acquire()
            try:
                if self._aborting:
                    return
                torch.set_num_threads(threads_per_op)  # OpenMP settings are per thread
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                with torch.no_grad():  # grad mode is per thread; the graph is _OneProcess
                    self._resume(r)
                    try:
                        results[r] = fns[r]()
                    finally:
                        self._pause(r)
            except _Aborted:
                pass
            except BaseException as e:  # re-raised by the driver
                errors[r] = e
            finally:
                done[r] = True
                self.progress += 1
                self._parked.release()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        deadlock = False
        while not all(done) and not errors:
            before = self.progress
            for r in range(n):
                if done[r]:
                    continue
                self._go[r].release()
                self._parked.acquire()
                if errors:
                    break
            if not errors and self.progress == before:
                deadlock = True
                break
        waiting = [r for r in range(n) if not done[r]]
        if errors or deadlock:
            self._aborting = True
            for r in range(n):
                if not done[r]:
                    self._go[r].release()
                    self._parked.acquire()
        for t in threads:
            t.join()
        if errors:
            r = min(errors)
            raise RuntimeError(f"one-process StarTrail: rank {r} failed") from errors[r]
        if deadlock:
            raise RuntimeError(
                "one-process StarTrail: every unfinished rank waits for a message or collective "
                "no rank will post (deadlock); waiting ranks: "
                f"{waiting}"
            )
        return results


class _World:
    """Mailboxes and collective slots shared by the ranks of one call."""

    def __init__(self, layout: StarTrailLayout):
        self.layout = layout
        self.baton: _Baton | None = None
        self.mail: dict[tuple[int, int, int], Tensor] = {}
        self.slots: dict[tuple[int, int], dict[int, Tensor]] = {}
        self.reads: dict[tuple[int, int], int] = {}


class _LocalHandle:
    def __init__(self, world: _World, key: tuple[int, int, int] | None, value: Tensor | None):
        self._world, self._key, self._value, self._done = world, key, value, False

    def wait(self) -> Tensor:
        if self._done:
            raise RuntimeError("P2PHandle.wait() called twice")
        self._done = True
        if self._key is None:  # a self-exchange
            return self._value
        w, key = self._world, self._key
        w.baton._pause(key[1])
        try:
            w.baton.wait_until(key[1], lambda: key in w.mail)
        finally:
            w.baton._resume(key[1])
        got = w.mail.pop(key)
        if got.shape != self._value.shape or got.dtype != self._value.dtype:
            raise RuntimeError(
                f"rank {key[1]} expected {tuple(self._value.shape)} {self._value.dtype} from rank "
                f"{key[0]}, got {tuple(got.shape)} {got.dtype}"
            )
        return got


class _LocalP2P:
    """``P2PComm``'s interface in one process: a send is a clone into a mailbox."""

    def __init__(self, world: _World, cp_rank: int, ledger: CommLedger | None):
        self.world, self.cp_rank, self.ledger = world, cp_rank, ledger
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}

    def exchange(self, send: Tensor, dst: int, src: int, what: str, group: Any = None):
        me = self.cp_rank
        if (dst == me) != (src == me):
            raise ValueError(
                f"P2P exchange on CP rank {me}: dst={dst}, src={src}; a self-send "
                "must also be a self-receive"
            )
        if dst == me:
            return _LocalHandle(self.world, None, send)
        n_out, n_in = self._sent.get(dst, 0), self._received.get(src, 0)
        self._sent[dst], self._received[src] = n_out + 1, n_in + 1
        self.world.baton._pause(me)
        self.world.mail[(me, dst, n_out)] = send.detach().clone()
        self.world.baton.progress += 1
        self.world.baton._resume(me)
        if self.ledger is not None:
            self.ledger.record("p2p", "send", what, _nbytes(send), dst)
        return _LocalHandle(self.world, (src, me, n_in), send)


class _LocalTeam:
    """``TeamComm``'s interface in one process: members' posts gathered in member order."""

    def __init__(self, world: _World, cp_rank: int, ledger: CommLedger | None):
        lay = world.layout
        self.world, self.rank, self.ledger = world, cp_rank, ledger
        self.size = lay.team_size
        self.team, self.member = lay.coord(cp_rank)
        self._calls = 0

    def _exchange(self, x: Tensor) -> list[Tensor]:
        w, key = self.world, (self.team, self._calls)
        self._calls += 1
        w.baton._pause(self.rank)
        try:
            slot = w.slots.setdefault(key, {})
            slot[self.member] = x.detach().clone()
            w.baton.progress += 1
            w.baton.wait_until(self.rank, lambda: len(slot) == self.size)
            posts = [slot[m] for m in range(self.size)]
            w.reads[key] = w.reads.get(key, 0) + 1
            if w.reads[key] == self.size:
                del w.slots[key], w.reads[key]
        finally:
            w.baton._resume(self.rank)
        return posts

    def all_gather(self, x: Tensor, what: str) -> Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.cat(self._exchange(x), dim=0)
        if self.ledger is not None:
            self.ledger.record("collective", "all_gather", what, (self.size - 1) * _nbytes(x))
        return out

    def reduce_scatter(self, x: Tensor, what: str) -> Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        posts = self._exchange(x)
        c, m = self.size, self.member
        # gloo's ring reduce-scatter order (measured for C = 3, 4): start at member
        # m-1, go down, add member m's own part last. Any order is exact for C <= 2.
        order = [(m - 1 - i) % c for i in range(c)]
        out = posts[order[0]].chunk(c, dim=0)[m].clone()
        for j in order[1:]:
            out += posts[j].chunk(c, dim=0)[m]
        if self.ledger is not None:
            self.ledger.record("collective", "reduce_scatter", what, (self.size - 1) * _nbytes(out))
        return out


class _OneProcess(torch.autograd.Function):
    """One autograd node for all ranks: forward and backward each run every rank."""

    @staticmethod
    def forward(ctx, run: dict, *tensors):
        p = run["layout"].cp_size
        qs, ks, vs = tensors[:p], tensors[p : 2 * p], tensors[2 * p :]
        world = _World(run["layout"])
        world.baton = _Baton(p, qs[0].device, run["timer"])
        ledgers = run["ledgers"]
        cxs: list[Any] = [None] * p

        def rank_fn(r: int) -> Callable[[], Any]:
            def fn():
                groups = StarTrailGroups(run["layout"], None, r, None, None)
                led = ledgers[r]
                if led is not None:
                    led.phase = "fwd"
                comms = (_LocalTeam(world, r, led), _LocalP2P(world, r, led))
                return _forward(
                    qs[r],
                    ks[r],
                    vs[r],
                    groups,
                    run["causal"],
                    run["scale"],
                    run["kernel"],
                    led,
                    comms,
                )

            return fn

        results = world.baton.run([rank_fn(r) for r in range(p)])
        flat = []
        for r, (out, saved, cx) in enumerate(results):
            cxs[r] = cx
            flat += [out, *saved]
        ctx.save_for_backward(*flat)
        ctx.run, ctx.cxs, ctx.world = run, cxs, world
        return tuple(res[0] for res in results)

    @staticmethod
    @once_differentiable
    def backward(ctx, *douts):
        run, cxs, world = ctx.run, ctx.cxs, ctx.world
        p = run["layout"].cp_size
        saved = ctx.saved_tensors
        world.baton = _Baton(p, douts[0].device, run["timer"])

        def rank_fn(r: int) -> Callable[[], Any]:
            def fn():
                out, q_team, kv_team, lse_team = saved[4 * r : 4 * r + 4]
                led = run["ledgers"][r]
                if led is not None:
                    led.phase = "bwd"
                return _backward(
                    douts[r].contiguous(),
                    out,
                    (q_team, kv_team, lse_team),
                    cxs[r],
                    run["scale"],
                    run["kernel"],
                )

            return fn

        grads = world.baton.run([rank_fn(r) for r in range(p)])
        return (None, *(g[0] for g in grads), *(g[1] for g in grads), *(g[2] for g in grads))


def one_process_attention(
    q_shards: Sequence[Tensor],
    k_shards: Sequence[Tensor],
    v_shards: Sequence[Tensor],
    team_size: int,
    *,
    placement: Placement = "team",
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
    ledgers: Sequence[CommLedger | None] | None = None,
    timer: RankTimer | None = None,
) -> list[Tensor]:
    """StarTrail over ``P = len(q_shards)`` CP ranks, all run in this process.

    Args:
        q_shards, k_shards, v_shards: rank r's local ``[s_local, b, h, d]``
            tensors (``zigzag_shard`` of the full sequence for causal), all on
            one device; differentiable.
        team_size: C, with C*C dividing P.
        placement, causal, softmax_scale, kernel: as ``startrail_attention``.
        ledgers: one ``CommLedger`` (or ``None``) per rank; each records what
            that rank would send, exactly as in a multi-rank run.
        timer: a ``RankTimer`` that accumulates each rank's compute time.

    Returns:
        rank r's output ``[s_local, b, heads_q, head_dim]``, for every r.
    """
    p = len(q_shards)
    if len(k_shards) != p or len(v_shards) != p:
        raise ValueError(
            f"q_shards, k_shards, v_shards need one tensor per rank; got {p}, {len(k_shards)}, "
            f"{len(v_shards)}"
        )
    layout = StarTrailLayout(p, team_size, placement)  # ValueError on a bad setting
    for r in range(p):
        validate_inputs(q_shards[r], k_shards[r], v_shards[r], p, causal)
        for name, xs in (("q", q_shards), ("k", k_shards), ("v", v_shards)):
            x0, x = xs[0], xs[r]
            if x.shape != x0.shape or x.dtype != x0.dtype or x.device != x0.device:
                raise ValueError(
                    f"{name}_shards[{r}] is {tuple(x.shape)} {x.dtype} on {x.device}; rank 0 "
                    f"has {tuple(x0.shape)} {x0.dtype} on {x0.device}: all ranks must agree"
                )
    if ledgers is None:
        ledgers = [None] * p
    elif len(ledgers) != p:
        raise ValueError(f"ledgers needs one entry per rank ({p}), got {len(ledgers)}")
    q0 = q_shards[0]
    scale = float(q0.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    if isinstance(kernel, str):
        kernel = get_kernel(kernel, q0.dtype, device=q0.device, head_dim=q0.shape[-1])
    run = dict(
        layout=layout,
        causal=bool(causal),
        scale=scale,
        kernel=kernel,
        ledgers=list(ledgers),
        timer=timer,
    )
    return list(_OneProcess.apply(run, *q_shards, *k_shards, *v_shards))
