"""The one communication layer: the seam (protocols), its two transports, accounting.

``protocols.py``   ``TeamCollectives``, ``PeerExchange``, ``Handle``: what the schedule needs.
``torch_dist.py``  ``TeamComm``, ``P2PComm``: the transport over process groups (NCCL, gloo).
``in_process.py``  every rank in one process (``one_process.py``'s transport).
``ledger.py``      ``CommLedger``: bytes and calls of every transfer, per rank (and how
                   long each wait blocked).
``overlap.py``     ``CommOptions`` (injected delay, no-overlap baseline), timed handles.
"""

from .ledger import CommEvent, CommLedger, nbytes
from .overlap import DEFAULT_COMM, CommOptions, DoneHandle, TimedHandle
from .protocols import Handle, PeerExchange, TeamCollectives
from .torch_dist import (
    P2PComm,
    P2PHandle,
    TeamComm,
    all_reduce_sum,
    all_to_all_bytes,
    check_agreement,
    tap_all_to_all,
)

__all__ = [
    "DEFAULT_COMM",
    "CommEvent",
    "CommLedger",
    "CommOptions",
    "DoneHandle",
    "Handle",
    "P2PComm",
    "P2PHandle",
    "PeerExchange",
    "TeamCollectives",
    "TeamComm",
    "TimedHandle",
    "all_reduce_sum",
    "all_to_all_bytes",
    "check_agreement",
    "nbytes",
    "tap_all_to_all",
]
