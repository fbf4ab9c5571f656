"""The 2-D split's all-to-alls on one rank: sequence shard <-> head shard, with autograd.

``schedule/ulysses.py``'s Note [the 2-D split] says what each rank holds before and after.
``SeqToHeads`` turns this rank's ``[s, b, h, d]`` tensors into its Ulysses group's tokens
for its heads, ``[U*s, b, h/U, d]``, rows in the ring rank's zigzag order
(``schedule.ulysses.ring_segments``); ``HeadsToSeq`` is its inverse. Each one's backward
is the other's forward on the gradients. The tensors of one call travel at once (one
all-to-all each, started together, then waited on).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import CommLedger, TeamComm
from ..validation import first_order_only

__all__ = ["HeadsToSeq", "SeqToHeads"]


def _ring_rows(x: Tensor, runs: list[tuple[int, int]]) -> Tensor:
    """The received ``[U*s, ...]`` rows in ring order (``runs``; ``[]``: as they are)."""
    if not runs:
        return x
    return torch.cat([x.narrow(0, a, n) for a, n in runs])


def _member_rows(y: Tensor, runs: list[tuple[int, int]]) -> Tensor:
    """The inverse of ``_ring_rows``: rows back at their members' places."""
    if not runs:
        return y
    out = torch.empty_like(y)
    at = 0
    for a, n in runs:
        out.narrow(0, a, n).copy_(y.narrow(0, at, n))
        at += n
    if at != y.shape[0]:
        raise RuntimeError(f"the ring order covers {at} of {y.shape[0]} rows")
    return out


def _to_heads_start(comm: TeamComm, x: Tensor, what: str):
    """Start sending head group j of ``[s, b, h, d]`` to member j."""
    s, b, h, d = x.shape
    u = comm.size
    send = x.reshape(s, b, u, h // u, d).permute(2, 0, 1, 3, 4).reshape(u * s, b, h // u, d)
    return comm.all_to_all_start(send, what)


def _to_seq_start(comm: TeamComm, y: Tensor, runs, what: str):
    """Start sending member j's rows of ``[U*s, b, h/U, d]`` (ring order) back to it."""
    return comm.all_to_all_start(_member_rows(y, runs), what)


def _seq_done(recv: Tensor, u: int) -> Tensor:
    """``[U*s, b, h/U, d]`` (head group j from member j) -> ``[s, b, h, d]``."""
    n, b, hu, d = recv.shape
    s = n // u
    return recv.view(u, s, b, hu, d).permute(1, 2, 0, 3, 4).reshape(s, b, u * hu, d)


def _phase(ledger: CommLedger | None, phase: str) -> None:
    if ledger is not None:
        ledger.phase = phase


class SeqToHeads(torch.autograd.Function):
    """``apply(comm, runs, ledger, names, *xs)``: each ``[s, b, h, d]`` -> ``[U*s, b, h/U,
    d]`` over the Ulysses group ``comm``; ``names`` are the ledger's ``what`` of each, in
    the forward (their gradients go back as ``"d" + name``)."""

    @staticmethod
    def forward(ctx, comm, runs, ledger, names, *xs):
        ctx.comm, ctx.runs, ctx.ledger, ctx.names = comm, runs, ledger, names
        _phase(ledger, "fwd")
        handles = [_to_heads_start(comm, x, w) for x, w in zip(xs, names, strict=True)]
        return tuple(_ring_rows(h.wait(), runs) for h in handles)

    @staticmethod
    @first_order_only("the 2-D split's all-to-all")
    def backward(ctx, *grads):
        _phase(ctx.ledger, "bwd")
        handles = [
            _to_seq_start(ctx.comm, g, ctx.runs, "d" + w)
            for g, w in zip(grads, ctx.names, strict=True)
        ]
        return (None, None, None, None, *(_seq_done(h.wait(), ctx.comm.size) for h in handles))


class HeadsToSeq(torch.autograd.Function):
    """``apply(comm, runs, ledger, name, y)``: ``[U*s, b, h/U, d]`` (ring order) -> ``[s,
    b, h, d]``, the inverse of ``SeqToHeads``; its gradient travels as ``"d" + name``."""

    @staticmethod
    def forward(ctx, comm, runs, ledger, name, y):
        ctx.comm, ctx.runs, ctx.ledger, ctx.name = comm, runs, ledger, name
        _phase(ledger, "fwd")
        return _seq_done(_to_seq_start(comm, y, runs, name).wait(), comm.size)

    @staticmethod
    @first_order_only("the 2-D split's all-to-all")
    def backward(ctx, grad):
        _phase(ctx.ledger, "bwd")
        recv = _to_heads_start(ctx.comm, grad, "d" + ctx.name).wait()
        return None, None, None, None, _ring_rows(recv, ctx.runs)
