"""Every CP rank in one process: the in-process transport of the communication seam.

``InProcessTeam`` and ``InProcessP2P`` implement ``TeamCollectives`` and
``PeerExchange`` (``protocols.py``) between ranks that run as cooperative
threads of one process (``Baton``), so ``one_process.py`` can run the
unchanged per-rank schedule of ``rank/`` for all ranks on one device.

Scheduling: each rank runs in its own Python thread, but the threads are
coroutines: ``Baton.run`` hands a baton to one rank at a time, in rank order,
and a rank gives it back only when it must wait for a message or a collective
its peers have not posted yet. So exactly one rank executes at any moment, the
order is deterministic, and a rank's compute can be timed by the segments it
holds the baton outside communication (the ``timer``'s ``pause``/``resume``).

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
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ..schedule.layout import StarTrailLayout
from .ledger import CommLedger, nbytes
from .overlap import DoneHandle, receive_buffer
from .torch_dist import receive_buffers

__all__ = [
    "Aborted",
    "Baton",
    "InProcessHandle",
    "InProcessP2P",
    "InProcessTeam",
    "InProcessWorld",
    "SegmentTimer",
]


class SegmentTimer(Protocol):
    """What the baton tells a timer: a rank starts or stops computing, and (optionally,
    ``closed`` and ``transfer``: ``one_process.RankTimer``) which of its compute
    segments ran while a transfer was in flight."""

    def resume(self, rank: int) -> None: ...

    def pause(self, rank: int) -> None: ...


class Aborted(BaseException):
    """Raised in a rank thread when the driver stops the run (a peer failed)."""


class Baton:
    """Runs one callable per rank as cooperative threads: one at a time, rank order."""

    def __init__(self, world_size: int, device: torch.device, timer: SegmentTimer | None):
        self.n, self.device, self.timer = world_size, device, timer
        self._go = [threading.Semaphore(0) for _ in range(world_size)]
        self._parked = threading.Semaphore(0)
        self._aborting = False
        self.progress = 0

    def pause_timer(self, rank: int) -> None:
        if self.timer is not None:
            self.timer.pause(rank)

    def resume_timer(self, rank: int) -> None:
        if self.timer is not None:
            self.timer.resume(rank)

    def closed_segments(self, rank: int) -> int | None:
        """How many compute segments ``rank`` has closed (call while it is paused)."""
        closed = getattr(self.timer, "closed", None)
        return None if closed is None else closed(rank)

    def record_transfer(self, rank: int, info: tuple, first: int | None) -> None:
        """A transfer issued after ``first`` closed segments is waited on now (paused):
        the segments between ran while it was in flight."""
        if first is not None:
            self.timer.transfer(rank, *info, first, self.timer.closed(rank))

    def wait_until(self, rank: int, ready: Callable[[], bool]) -> None:
        """Called by rank ``rank`` (not timed): hand the baton back until ``ready()``."""
        while not ready():
            self._parked.release()
            self._go[rank].acquire()
            if self._aborting:
                raise Aborted
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
                    self.resume_timer(r)
                    try:
                        results[r] = fns[r]()
                    finally:
                        self.pause_timer(r)
            except Aborted:
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


class InProcessWorld:
    """Mailboxes and collective slots shared by the ranks of one call."""

    def __init__(self, layout: StarTrailLayout):
        self.layout = layout
        self.phase = "fwd"  # "fwd" / "bwd": what the transfers' timing records say
        self.baton: Baton | None = None
        self.mail: dict[tuple[int, int, int], Tensor] = {}
        self.slots: dict[tuple[int, int], dict[int, Tensor]] = {}
        self.reads: dict[tuple[int, int], int] = {}


class InProcessHandle:
    def __init__(
        self,
        world: InProcessWorld,
        key: tuple[int, int, int] | None,
        value: Tensor | None,
        info: tuple = (),
        first: int | None = None,
        out: Tensor | None = None,
    ):
        self._world, self._key, self._value, self._done = world, key, value, False
        self._info, self._first = info, first
        self._out = out  # the receive buffer the caller gave, if any

    def wait(self) -> Tensor:
        if self._done:
            raise RuntimeError("Handle.wait() called twice")
        self._done = True
        if self._key is None:  # a self-exchange
            return self._value
        w, key = self._world, self._key
        w.baton.pause_timer(key[1])
        try:
            w.baton.wait_until(key[1], lambda: key in w.mail)
            w.baton.record_transfer(key[1], self._info, self._first)
        finally:
            w.baton.resume_timer(key[1])
        got = w.mail.pop(key)
        want, self._value = self._value, None
        if got.shape != want.shape or got.dtype != want.dtype:
            raise RuntimeError(
                f"rank {key[1]} expected {tuple(want.shape)} {want.dtype} from rank "
                f"{key[0]}, got {tuple(got.shape)} {got.dtype}"
            )
        out, self._out = self._out, None
        return got if out is None else out.copy_(got)


class InProcessP2P:
    """``P2PComm``'s interface in one process: a send is a clone into a mailbox."""

    def __init__(self, world: InProcessWorld, cp_rank: int, ledger: CommLedger | None):
        self.world, self.cp_rank, self.ledger = world, cp_rank, ledger
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}

    def exchange(self, send: Tensor, dst: int, src: int, what: str, group: Any = None, out=None):
        me = self.cp_rank
        if (dst == me) != (src == me):
            raise ValueError(
                f"P2P exchange on CP rank {me}: dst={dst}, src={src}; a self-send "
                "must also be a self-receive"
            )
        if dst == me:
            return InProcessHandle(self.world, None, send)
        if out is not None:
            receive_buffer(send, out)  # checked as the process-group transport does
        first = self._post([(dst, send)], what)
        return self._receive(src, send, (self.world.phase, "p2p", what, nbytes(send)), first, out)

    def exchange_many(self, sends, srcs, like: Tensor, what: str, out: Tensor | None = None):
        me = self.cp_rank
        srcs = list(srcs)
        bufs = receive_buffers(me, sends, srcs, like, out)
        sent = [(d, t) for d, t in sends if d != me]
        first = self._post(sent, what)
        info = (self.world.phase, "p2p", what, sum(nbytes(t) for _, t in sent))
        handles, direct = [], {}
        for i, s_ in enumerate(srcs):
            if s_ == me:
                handles.append(None)
                direct[i] = bufs[i]
                continue
            # the transfer's window is recorded once, on the first receive waited on
            timed = any(h is not None for h in handles)
            into = bufs[i] if out is not None else None
            handles.append(self._receive(s_, like, info, None if timed else first, into))
        return _Many(handles, direct)

    def _post(self, sent: list[tuple[int, Tensor]], what: str) -> int | None:
        """Post each ``(dst, tensor)`` (a clone) in the mailboxes, in the ledger too;
        the compute segments closed so far (``Baton.closed_segments``)."""
        me, baton = self.cp_rank, self.world.baton
        baton.pause_timer(me)
        for d, t in sent:
            n_out = self._sent.get(d, 0)
            self._sent[d] = n_out + 1
            self.world.mail[(me, d, n_out)] = t.detach().clone()
            if self.ledger is not None:
                self.ledger.record("p2p", "send", what, nbytes(t), d, (d,))  # CP = global
        baton.progress += 1
        first = baton.closed_segments(me)
        baton.resume_timer(me)
        return first

    def _receive(self, src: int, like: Tensor, info: tuple, first, out) -> InProcessHandle:
        """The handle of the next message from ``src`` (shaped like ``like``)."""
        n_in = self._received.get(src, 0)
        self._received[src] = n_in + 1
        return InProcessHandle(self.world, (src, self.cp_rank, n_in), like, info, first, out)


class _Many:
    """Several in-process receives waited on together (``exchange_many``)."""

    def __init__(self, handles: list, direct: dict[int, Tensor]):
        self._handles, self._direct, self._done = handles, direct, False

    def wait(self) -> list[Tensor]:
        if self._done:
            raise RuntimeError("Handle.wait() called twice")
        self._done = True
        got = [h.wait() if h is not None else None for h in self._handles]
        for i, t in self._direct.items():
            got[i] = t
        return got


class InProcessTeam:
    """``TeamComm``'s interface in one process: members' posts gathered in member order."""

    def __init__(self, world: InProcessWorld, cp_rank: int, ledger: CommLedger | None):
        lay = world.layout
        self.world, self.rank, self.ledger = world, cp_rank, ledger
        self.size = lay.team_size
        self.team, self.member = lay.coord(cp_rank)
        self.members = tuple(lay.team_ranks(self.team))  # one process: CP rank = global rank
        self._calls = 0

    def _post(self, x: Tensor, finish, what: str, sent: int):
        """Post this member's part of the next collective; the handle's ``wait`` collects
        the members' posts (in member order) and returns ``finish(posts)``."""
        w, key = self.world, (self.team, self._calls)
        self._calls += 1
        w.baton.pause_timer(self.rank)
        slot = w.slots.setdefault(key, {})
        slot[self.member] = x.detach().clone()
        w.baton.progress += 1
        first = w.baton.closed_segments(self.rank)
        w.baton.resume_timer(self.rank)
        info = (w.phase, "collective", what, sent)
        return _Collective(self, key, slot, finish, info, first)

    def all_gather_start(self, x: Tensor, what: str):
        if self.size == 1:
            return DoneHandle(x)
        x = x.contiguous()
        sent = (self.size - 1) * nbytes(x)
        if self.ledger is not None:
            self.ledger.record("collective", "all_gather", what, sent, group=self.members)
        return self._post(x, lambda posts: torch.cat(posts, dim=0), what, sent)

    def reduce_scatter_start(self, x: Tensor, what: str):
        if self.size == 1:
            return DoneHandle(x)
        x = x.contiguous()
        c, m = self.size, self.member
        sent = (c - 1) * nbytes(x) // c
        if self.ledger is not None:
            self.ledger.record("collective", "reduce_scatter", what, sent, group=self.members)

        def finish(posts: list[Tensor]) -> Tensor:
            # gloo's ring reduce-scatter order (measured for C = 3, 4): start at member
            # m-1, go down, add member m's own part last. Any order is exact for C <= 2.
            order = [(m - 1 - i) % c for i in range(c)]
            out = posts[order[0]].chunk(c, dim=0)[m].clone()
            for j in order[1:]:
                out += posts[j].chunk(c, dim=0)[m]
            return out

        return self._post(x, finish, what, sent)

    def all_gather(self, x: Tensor, what: str) -> Tensor:
        return self.all_gather_start(x, what).wait()

    def reduce_scatter(self, x: Tensor, what: str) -> Tensor:
        return self.reduce_scatter_start(x, what).wait()


class _Collective:
    """An in-process collective in flight: this member has posted its part."""

    def __init__(self, team: InProcessTeam, key, slot: dict, finish, info: tuple, first):
        self._team, self._key, self._slot, self._finish = team, key, slot, finish
        self._info, self._first, self._done = info, first, False

    def wait(self) -> Tensor:
        if self._done:
            raise RuntimeError("Handle.wait() called twice")
        self._done = True
        t, w, key, slot = self._team, self._team.world, self._key, self._slot
        w.baton.pause_timer(t.rank)
        try:
            w.baton.wait_until(t.rank, lambda: len(slot) == t.size)
            posts = [slot[m] for m in range(t.size)]
            w.reads[key] = w.reads.get(key, 0) + 1
            if w.reads[key] == t.size:
                del w.slots[key], w.reads[key]
            w.baton.record_transfer(t.rank, self._info, self._first)
        finally:
            w.baton.resume_timer(t.rank)
        return self._finish(posts)
