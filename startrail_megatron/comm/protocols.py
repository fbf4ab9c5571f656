"""The communication seam: what the StarTrail schedule needs from a transport.

``rank/`` runs one rank's forward and backward against two objects:

* ``TeamCollectives`` over the C ranks of a team (the all-gathers of q, lse, dout
  and delta, the reduce-scatters of the output and dq), each available
  asynchronously (``*_start`` -> ``Handle``); the all-gather-KV peer
  uses the same interface over the whole CP group;
* ``PeerExchange`` for the P2P steps: the sub-ring steps (``exchange``), and the
  initial KV placement and the dK/dV sent home (``exchange_many``: one piece to or
  from each member of a team), each asynchronous, ``Handle.wait()`` giving what
  was received.

Two transports implement them: ``torch_dist.py`` (process groups, NCCL or
gloo) and ``in_process.py`` (every rank in one process, for the one-device
check). The algorithm is the same code for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

__all__ = ["Handle", "PeerExchange", "TeamCollectives"]


class Handle(Protocol):
    """An exchange in flight."""

    def wait(self) -> Tensor:
        """The received tensor (once; a second call raises). Never synchronizes the device."""
        ...


class TeamCollectives(Protocol):
    """Collectives over one group of ``size`` ranks, in member order.

    ``*_start`` returns at once: the collective runs while the caller computes, and
    ``Handle.wait()`` gives its result. Several may be in flight; every member starts
    them in the same order. The plain forms are ``*_start(...).wait()``.
    """

    size: int

    def all_gather_start(self, x: Tensor, what: str) -> Handle:
        """``all_gather``, asynchronous."""
        ...

    def reduce_scatter_start(self, x: Tensor, what: str) -> Handle:
        """``reduce_scatter``, asynchronous."""
        ...

    def all_gather(self, x: Tensor, what: str) -> Tensor:
        """``[n, ...]`` on each member -> ``[size*n, ...]``, member order."""
        ...

    def reduce_scatter(self, x: Tensor, what: str) -> Tensor:
        """``[size*n, ...]`` on each member -> this member's ``n`` rows of the sum."""
        ...


class PeerExchange(Protocol):
    """Point-to-point exchanges between the CP ranks of one CP group."""

    cp_rank: int

    def exchange(
        self,
        send: Tensor,
        dst: int,
        src: int,
        what: str,
        group: Any = None,
        out: Tensor | None = None,
    ) -> Handle:
        """Send ``send`` to CP rank ``dst``, receive a tensor like it from ``src``.

        ``group`` is a communicator holding both peers (a sub-ring), or ``None``
        for the CP group. ``out``: a buffer like ``send`` to receive into (one the
        caller no longer needs: buffers reused across steps), else a new one. A self-exchange (``dst == src == cp_rank``) moves
        nothing; ``dst == cp_rank`` without ``src == cp_rank`` (or the reverse)
        is a ``ValueError``. Returns at once.
        """
        ...

    def exchange_many(
        self,
        sends: Sequence[tuple[int, Tensor]],
        srcs: Sequence[int],
        like: Tensor,
        what: str,
        out: Tensor | None = None,
    ) -> Handle:
        """Send each ``(dst, tensor)`` and receive one tensor like ``like`` from each of
        ``srcs``, all at once, over the CP group; ``wait()`` gives the received tensors
        in ``srcs`` order. A tensor sent to this rank is the one received from it (no
        transfer); sending to oneself without receiving from oneself, or the reverse,
        is a ``ValueError``. ``out``: one contiguous buffer holding the received pieces
        along dim 0 in ``srcs`` order (the pieces are then views of it). Returns at once.
        """
        ...
