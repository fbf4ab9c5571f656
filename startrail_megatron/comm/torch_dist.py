"""The transport over ``torch.distributed``: team collectives and P2P exchanges.

Implements the ``TeamCollectives`` and ``PeerExchange`` protocols
(``protocols.py``) on process groups. Everything goes through
``torch.distributed`` by module attribute (``dist.batch_isend_irecv``,
``dist.all_gather_into_tensor``, ...) so outside tools that patch or trace
those functions see every call. Collectives use the flat, concatenated tensor
forms that both NCCL and gloo accept (gloo refuses a stacked all-gather output
and PREMUL_SUM). Collectives and exchanges start asynchronously (``async_op=True``,
``batch_isend_irecv``) and return a handle; waiting on it never synchronizes the
device: ``Work.wait()`` only orders streams on NCCL. ``CommOptions`` (``overlap.py``)
adds the benchmark's injected delay and no-overlap mode, and on CPU ranks each wait is
timed into the ledger (how much of the transfer was hidden). Every call is recorded in the
``CommLedger`` given (``ledger.py``). One exception to "every call goes
through here": DeepSpeed-Ulysses (the Ulysses peer) runs DeepSpeed's own
all-to-alls; ``tap_all_to_all`` records them in the ledger.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from .ledger import CommLedger, nbytes
from .overlap import DEFAULT_COMM, CommOptions, DoneHandle, receive_buffer, start_transfer

__all__ = [
    "P2PComm",
    "P2PHandle",
    "TeamComm",
    "all_reduce_sum",
    "all_to_all_bytes",
    "check_agreement",
    "tap_all_to_all",
]

# torch 2.13 renamed the flat collectives (the old names warn); one shim here, so the
# deprecated names are never called where the new ones exist (no warning filter per call:
# ``warnings.catch_warnings`` is not thread-safe, and the backward runs on autograd's thread).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (``None``: the default world), for error messages."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _failed(
    what: str, group: dist.ProcessGroup | None, detail: str, err: Exception
) -> RuntimeError:
    """A communication failure that names the operation, the group and the peers."""
    return RuntimeError(
        f"StarTrail {what} failed on global rank {dist.get_rank()} in the group of global ranks "
        f"{_group_ranks(group)}{detail}: a peer died or did not answer within the group's "
        f"timeout ({type(err).__name__}: {err})"
    )


def check_agreement(
    group: dist.ProcessGroup | None,
    fields: dict[str, int],
    device: torch.device,
    hint: str = "every CP rank must call with the same shapes, dtype, causal and StarTrail groups",
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks pass equal ``fields``.

    One all-reduce (MAX of the values and of their negations) of ``2 * len(fields)``
    integers; reading the result synchronizes the device once, so callers check a
    setting the first time they see it, not on every call.
    """
    vals = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    both = torch.cat((vals, -vals))
    try:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:
        raise _failed("agreement check", group, "", e) from e
    n = len(fields)
    hi, lo = both[:n].tolist(), (-both[n:]).tolist()
    bad = [f"{k} ({a} to {b})" for k, a, b in zip(fields, lo, hi) if a != b]
    if bad:
        raise ValueError(
            f"the ranks of the CP group (global ranks {_group_ranks(group)}) disagree on "
            f"{', '.join(bad)}: {hint}"
        )


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup | None, what: str) -> Tensor:
    """Sum ``x`` in place over ``group`` (``None``: the world) and return it; errors name
    the group and the peers. For gradients of replicated parameters (``dit/train.py``)."""
    try:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as e:
        raise _failed(f"all-reduce of {what!r}", group, "", e) from e
    return x


class TeamComm:
    """All-gather / reduce-scatter / all-to-all over one process group of ``size`` ranks.

    StarTrail uses it over a team (C ranks); the all-gather-KV peer over the
    whole CP group (P ranks); the 2-D split's all-to-alls over a Ulysses group. ``*_start`` returns at once with a handle (the
    collective runs while the caller computes); the plain forms wait.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        size: int,
        ledger: CommLedger | None,
        options: CommOptions = DEFAULT_COMM,
    ):
        self.group, self.size, self.ledger, self.options = group, size, ledger, options
        self._ranks: tuple[int, ...] | None = None

    def _members(self) -> tuple[int, ...]:
        """The group's global ranks, in group order (asked once; for the ledger)."""
        if self._ranks is None:
            self._ranks = tuple(_group_ranks(self.group))
        return self._ranks

    def _start(self, fn, name: str, out: Tensor, x: Tensor, what: str, sent: int, **kw):
        def failed(e: Exception) -> RuntimeError:
            return _failed(f"{name.replace('_', '-')} of {what!r}", self.group, "", e)

        try:
            work = fn(out, x, group=self.group, async_op=True, **kw)
        except RuntimeError as e:
            raise failed(e) from e
        if self.ledger is not None:
            self.ledger.record("collective", name, what, sent, group=self._members())
        host = x.device.type != "cuda"
        return start_transfer(
            P2PHandle([work], out, failed, x), self.ledger, "collective", what, self.options, host,
            sent,
        )  # fmt: skip

    def all_gather_start(self, x: Tensor, what: str):
        """Start gathering ``[n, ...]`` from every rank; the handle gives ``[size*n, ...]``,
        member order."""
        if self.size == 1:
            return DoneHandle(x)
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        return self._start(_all_gather, "all_gather", out, x, what, (self.size - 1) * nbytes(x))

    def reduce_scatter_start(self, x: Tensor, what: str):
        """Start summing ``[size*n, ...]`` over the ranks; the handle gives this member's
        ``n`` rows of the sum."""
        if self.size == 1:
            return DoneHandle(x)
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        sent = (self.size - 1) * nbytes(out)
        return self._start(
            _reduce_scatter, "reduce_scatter", out, x, what, sent, op=dist.ReduceOp.SUM
        )

    def all_to_all_start(self, x: Tensor, what: str):
        """Start an even all-to-all: rows ``j*n .. (j+1)*n`` of ``[size*n, ...]`` go to
        member j; the handle gives ``[size*n, ...]`` whose rows ``j*n ..`` came from member
        j (``all_to_all_single``, which NCCL and gloo both take; the Ulysses groups of
        ``UlyssesStarTrailGroups``). Sends (size-1)/size of ``x``."""
        if self.size == 1:
            return DoneHandle(x)
        if x.shape[0] % self.size:
            raise ValueError(
                f"all-to-all of {what!r}: {x.shape[0]} rows do not split over {self.size} ranks"
            )
        x = x.contiguous()
        out = torch.empty_like(x)
        sent = (self.size - 1) * nbytes(x) // self.size
        return self._start(dist.all_to_all_single, "all_to_all", out, x, what, sent)

    def all_gather(self, x: Tensor, what: str) -> Tensor:
        """[n, ...] on each rank -> [size*n, ...], member order."""
        return self.all_gather_start(x, what).wait()

    def reduce_scatter(self, x: Tensor, what: str) -> Tensor:
        """[size*n, ...] on each rank -> the sum's n rows of this member."""
        return self.reduce_scatter_start(x, what).wait()

    def all_to_all(self, x: Tensor, what: str) -> Tensor:
        """``all_to_all_start(x, what).wait()``."""
        return self.all_to_all_start(x, what).wait()


class P2PHandle:
    """A transfer in flight (an exchange, or a collective: one ``Work``); ``wait()`` waits
    on its works and returns ``result`` (the received tensor or tensors)."""

    def __init__(self, works: list, result, on_error=None, keep=None):
        self._works, self._result, self._done = works, result, False
        self._on_error = on_error  # exception -> the error to raise instead (names the peers)
        self._keep = keep  # what was sent stays alive until the wait, whatever the caller drops

    def wait(self):
        if self._done:
            raise RuntimeError("Handle.wait() called twice")
        try:
            for w in self._works:
                w.wait()
        except RuntimeError as e:
            if self._on_error is None:
                raise
            raise self._on_error(e) from e
        # Neither the result nor the works is kept past the wait: the caller frees the
        # received buffer when done, however long it keeps the handle.
        result, self._result, self._done, self._keep = self._result, None, True, None
        self._works = []
        return result


class P2PComm:
    """Point-to-point exchanges between CP ranks of one CP group.

    Note [receives first]
    ~~~~~~~~~~~~~~~~~~~~~
    Every exchange posts its receives before its sends in the one
    ``batch_isend_irecv``. Gloo issues the ops one by one, and a gloo send goes out only
    after the peer's ready-to-receive notice, which can queue behind a whole message on
    the same connection: with the send posted first, both directions of a two-way
    exchange wait on each other's notices and run one after the other (measured on an
    emulated 200 Mbit/s link: 4.2 MB each way 0.348 s with sends first, 0.178 s with
    receives first). NCCL runs the batch as one group (``ncclGroupStart`` /
    ``ncclGroupEnd``): the order inside it changes nothing there.
    """

    def __init__(
        self,
        cp_group: dist.ProcessGroup | None,
        cp_rank: int,
        ledger: CommLedger | None,
        options: CommOptions = DEFAULT_COMM,
    ):
        self.group, self.cp_rank, self.ledger, self.options = cp_group, cp_rank, ledger, options

    def _global(self, cp_rank: int) -> int:
        if self.group is None:
            return cp_rank
        return dist.get_global_rank(self.group, cp_rank)

    def exchange(
        self,
        send: Tensor,
        dst: int,
        src: int,
        what: str,
        group: dist.ProcessGroup | None = None,
        out: Tensor | None = None,
    ):
        """Send ``send`` to CP rank ``dst`` and receive a tensor like it from ``src``.

        ``group`` is the communicator to use (a sub-ring group holding both
        peers; default the CP group); peers are always CP ranks. A
        self-exchange (dst == src == this rank) moves nothing. Returns at
        once; the transfer overlaps whatever runs before ``wait()``.
        """
        if (dst == self.cp_rank) != (src == self.cp_rank):
            raise ValueError(
                f"P2P exchange on CP rank {self.cp_rank}: dst={dst}, src={src}; a self-send "
                "must also be a self-receive"
            )
        if dst == self.cp_rank:
            return P2PHandle([], send)
        send = send.contiguous()
        recv = receive_buffer(send, out)
        comm = group or self.group
        g_dst, g_src = self._global(dst), self._global(src)
        ops = [dist.P2POp(dist.irecv, recv, g_src, comm), dist.P2POp(dist.isend, send, g_dst, comm)]
        peers = (
            f", P2P {what!r} from CP rank {self.cp_rank} to CP rank {dst} (global {g_dst}), "
            f"from CP rank {src} (global {g_src})"
        )
        return self._start(ops, [(dst, send)], recv, comm, peers, what, send.device)

    def _start(self, ops: list, sent: list, result, comm, peers: str, what: str, device):
        """Issue ``ops`` as one ``batch_isend_irecv`` on ``comm``, record the ``sent``
        ``(dst, tensor)`` pairs, and return the handle that gives ``result``.

        The receives come first in ``ops`` (Note [receives first])."""

        def failed(e: Exception) -> RuntimeError:
            return _failed("P2P exchange", comm, peers, e)

        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise failed(e) from e
        if self.ledger is not None:
            for d, t in sent:
                self.ledger.record("p2p", "send", what, nbytes(t), d, (self._global(d),))
        host = device.type != "cuda"
        handle = P2PHandle(works, result, failed, [t for _, t in sent])
        out_b = sum(nbytes(t) for _, t in sent)
        in_b = sum(nbytes(o.tensor) for o in ops if o.op is dist.irecv)
        return start_transfer(
            handle, self.ledger, "p2p", what, self.options, host, max(out_b, in_b)
        )  # fmt: skip

    def exchange_many(self, sends, srcs, like: Tensor, what: str, out: Tensor | None = None):
        """Send each ``(dst, tensor)``, receive one tensor like ``like`` from each of
        ``srcs`` (CP ranks), in one ``batch_isend_irecv`` over the CP group; the
        handle gives the received tensors in ``srcs`` order. A piece for this rank is
        the one received from it (no transfer). ``out``: one buffer to receive into,
        the pieces stacked along dim 0 in ``srcs`` order (the handle then gives views of
        it; the piece to oneself is copied in)."""
        me = self.cp_rank
        out = receive_buffers(me, sends, srcs, like, out)
        sent = [(d, t.contiguous()) for d, t in sends if d != me]
        ops = [  # receives first: Note [receives first]
            dist.P2POp(dist.irecv, buf, self._global(s_), self.group)
            for s_, buf in zip(srcs, out)
            if s_ != me
        ]
        ops += [dist.P2POp(dist.isend, t, self._global(d), self.group) for d, t in sent]
        if not ops:
            return P2PHandle([], out)
        peers = f", P2P {what!r} from CP rank {me} to CP ranks {[d for d, _ in sends]}, "
        peers += f"from CP ranks {list(srcs)}"
        return self._start(ops, sent, out, self.group, peers, what, like.device)


def receive_buffers(me: int, sends, srcs, like: Tensor, out: Tensor | None) -> list:
    """``exchange_many``'s checks and receive buffers (the piece to oneself filled in)."""
    srcs = list(srcs)
    mine = [t for d, t in sends if d == me]
    if len(mine) > 1 or (len(mine) == 1) != (srcs.count(me) == 1):
        raise ValueError(
            f"P2P exchange_many on CP rank {me}: sends to {[d for d, _ in sends]}, "
            f"receives from {srcs}; a self-send must also be a self-receive, once"
        )
    if out is None:
        bufs = [None if s == me else like.new_empty(like.shape) for s in srcs]
        if mine:
            bufs[srcs.index(me)] = mine[0]
        return bufs
    want = (len(srcs) * like.shape[0], *like.shape[1:])
    if tuple(out.shape) != want or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(
            f"exchange_many out= must be a contiguous {want} {like.dtype} buffer, got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    bufs = list(out.chunk(len(srcs), dim=0))
    if mine:
        bufs[srcs.index(me)].copy_(mine[0])
    return bufs


class _AllToAllTap(torch.autograd.Function):
    """Identity that records one all-to-all of its input (forward) and of its gradient,
    and sleeps ``delay_s`` beside each (a blocking transfer: the delay is all exposed)."""

    @staticmethod
    def forward(ctx, x, ledger, size, what, grad_what, options, members):
        ctx.ledger, ctx.size, ctx.grad_what, ctx.options = ledger, size, grad_what, options
        ctx.members = members
        _tap(ledger, "collective", what, all_to_all_bytes(x, size), options, members)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.ledger is not None:
            ctx.ledger.phase = "bwd"
        nb = all_to_all_bytes(grad, ctx.size)
        _tap(ctx.ledger, "collective", ctx.grad_what, nb, ctx.options, ctx.members)
        return grad, None, None, None, None, None, None


def _tap(
    ledger: CommLedger | None, kind: str, what: str, nb: int, options: CommOptions, members
) -> None:
    delay_s = options.delay_for(nb)
    if delay_s:
        time.sleep(delay_s)
    if ledger is not None:
        ledger.record(kind, "all_to_all", what, nb, group=members)
        if delay_s:
            ledger.record_wait(ledger.phase, kind, what, 0.0, delay_s)


def all_to_all_bytes(x: Tensor, size: int) -> int:
    """Bytes a rank sends in an even all-to-all of ``x`` over ``size`` ranks: (size-1)/size."""
    return (size - 1) * nbytes(x) // size


def tap_all_to_all(
    x: Tensor,
    ledger: CommLedger | None,
    size: int,
    what: str,
    grad_what: str,
    options: CommOptions = DEFAULT_COMM,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Account an all-to-all that another library performs on ``x`` (and on its gradient)
    over ``group`` (``None``: the world; the ledger records its members).

    DeepSpeed-Ulysses issues its own all-to-alls inside ``DistributedAttention``;
    placing this identity at the tensor that crosses each one records the
    transfer in ``ledger`` (``what`` in the forward, ``grad_what`` when the
    gradient crosses back in the backward). Tests compare these records with
    the ``torch.distributed.all_to_all_single`` calls actually made. ``options``'
    injected delay (``CommOptions.delay_for`` its bytes, CPU ranks) is slept beside
    each, as a slower link would make the blocking all-to-all take that much longer.
    """
    if (ledger is None and not options.delays) or size == 1:
        return x
    members = tuple(_group_ranks(group)) if ledger is not None else None
    return _AllToAllTap.apply(x, ledger, size, what, grad_what, options, members)
