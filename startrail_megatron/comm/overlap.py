"""Transfers in flight: the benchmark's knobs (injected delay, no overlap) and the record
of how much of each transfer the rank hid behind other work.

``CommOptions`` says how a transport runs its transfers; the defaults are production
(overlap, no delay). ``TimedHandle`` wraps one transfer's handle on CPU ranks:

* ``delay_s``: the transfer completes no sooner than ``delay_s`` after it was issued
  (the wait sleeps out the rest), as if the link were that slow. Work done between
  the issue and the wait hides it; a wait that comes at once pays it all.
* ``overlap=False``: every transfer is waited on as it is issued, so nothing overlaps:
  the same code and bytes, the baseline an overlapped run is measured against.
* The record: ``in flight`` = seconds from the issue to the ``wait()`` call (the rank
  ran other work meanwhile), ``exposed`` = seconds the ``wait()`` blocked. The hidden
  fraction of a transfer is in_flight / (in_flight + exposed): 1 when the wait found it
  done, 0 when it was waited on at once. It is a host-clock measure and only means
  something where a wait blocks the host until the bytes are there: gloo's CPU tensors
  (and the in-process transport, ``RankTimer``). On CUDA, ``Work.wait()`` only orders
  streams and returns at once, so nothing is recorded there and ``delay_s`` is refused;
  use a profiler's timeline.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .ledger import CommLedger

__all__ = [
    "DEFAULT_COMM",
    "CommOptions",
    "DoneHandle",
    "TimedHandle",
    "receive_buffer",
    "refuse_device_delay",
    "start_transfer",
]


def receive_buffer(send, out):
    """``out`` checked to be like ``send`` (shape, dtype, device), or a new buffer."""
    if out is None:
        return send.new_empty(send.shape)
    if out.shape != send.shape or out.dtype != send.dtype or out.device != send.device:
        raise ValueError(
            f"exchange out= must be like the tensor sent: {tuple(send.shape)} {send.dtype} on "
            f"{send.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError("exchange out= must be contiguous")
    return out


@dataclass(frozen=True)
class CommOptions:
    """How a transport runs its transfers (``startrail_attention(comm_options=)``)."""

    overlap: bool = True
    """False: wait on every transfer as it is issued (the benchmark's no-overlap baseline)."""
    delay_s: float = 0.0
    """Each transfer completes no sooner than this many seconds after its issue (CPU
    ranks only: the benchmark's injected slowness)."""
    delay_s_per_mib: float = 0.0
    """And this many seconds more per MiB the transfer moves (the larger of what the rank
    sends and receives): a link of finite bandwidth, so larger transfers take longer (CPU
    ranks only)."""
    own_rows_first: bool | None = None
    """StarTrail (C > 1, dense, no dropout): True runs the first step's calls on the
    rank's own query rows before the team's queries (forward) and output gradients
    (backward) are waited on (``schedule.split_own_rows``): the same pairs in a few more
    calls, the gathers hidden behind them. False keeps that step's calls whole. None
    (default): the groups' setting (``StarTrailGroups.own_rows_first``: Megatron's
    ``--startrail-own-rows-first``, DeepSpeed's ``startrail.own_rows_first``) where set,
    else ``$STARTRAIL_OWN_ROWS_FIRST`` (``on``, ``off``) where set, else True where the
    gather would outlast the initial placement it starts beside
    (``schedule.own_rows_first_pays``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool):
            raise ValueError(f"comm_options.overlap={self.overlap!r} must be True or False")
        if self.own_rows_first is not None and not isinstance(self.own_rows_first, bool):
            raise ValueError(
                f"comm_options.own_rows_first={self.own_rows_first!r} must be True, False or "
                "None (automatic)"
            )
        for name in ("delay_s", "delay_s_per_mib"):
            d = getattr(self, name)
            bad = isinstance(d, bool) or not isinstance(d, (int, float))
            if bad or not math.isfinite(d) or d < 0:
                raise ValueError(
                    f"comm_options.{name}={d!r} must be a finite number of seconds >= 0"
                )

    @property
    def delays(self) -> bool:
        """Whether any delay is injected."""
        return bool(self.delay_s or self.delay_s_per_mib)

    def delay_for(self, nbytes: int) -> float:
        """The least time a transfer moving ``nbytes`` takes: ``delay_s`` plus
        ``delay_s_per_mib`` per MiB."""
        return self.delay_s + self.delay_s_per_mib * nbytes / 2**20


DEFAULT_COMM = CommOptions()


def refuse_device_delay(options: CommOptions) -> None:
    """``ValueError`` for an injected delay on tensors whose waits do not block the host
    (CUDA): a host-side sleep would not slow the transfer on its stream."""
    for name in ("delay_s", "delay_s_per_mib"):
        if getattr(options, name):
            raise ValueError(
                f"comm_options.{name}={getattr(options, name)} is for CPU ranks: on CUDA a "
                "host-side delay does not slow the transfer on its stream; allowed on CUDA: 0"
            )


class DoneHandle:
    """A transfer that moved nothing (a self-exchange, a group of one): ``wait()`` returns
    the tensor."""

    def __init__(self, value):
        self._value, self._done = value, False

    def wait(self):
        if self._done:
            raise RuntimeError("Handle.wait() called twice")
        value, self._value, self._done = self._value, None, True
        return value


class TimedHandle:
    """A transfer's handle with the injected delay and the ledger's overlap record."""

    def __init__(
        self,
        inner,
        ledger: CommLedger | None,
        kind: str,
        what: str,
        options: CommOptions,
        moved: int = 0,
    ):
        self._inner, self._ledger, self._kind, self._what = inner, ledger, kind, what
        self._delay = options.delay_for(moved)
        self._phase = None if ledger is None else ledger.phase
        self._t0 = time.perf_counter()

    def wait(self):
        if self._inner is None:
            raise RuntimeError("Handle.wait() called twice")
        t1 = time.perf_counter()
        result = self._inner.wait()
        self._inner = None
        if self._delay:
            rest = self._t0 + self._delay - time.perf_counter()
            if rest > 0:
                time.sleep(rest)
        t2 = time.perf_counter()
        if self._ledger is not None:
            self._ledger.record_wait(self._phase, self._kind, self._what, t1 - self._t0, t2 - t1)
        return result


def start_transfer(
    inner,
    ledger: CommLedger | None,
    kind: str,
    what: str,
    options: CommOptions,
    host_waits: bool,
    moved: int = 0,
):
    """The handle to give the schedule for a transfer just issued (``inner``) that moves
    ``moved`` bytes: timed where waits block the host (``host_waits``), waited on at once
    without ``overlap``."""
    if not host_waits:
        refuse_device_delay(options)
        if not options.overlap:
            return DoneHandle(inner.wait())
        return inner
    h = TimedHandle(inner, ledger, kind, what, options, moved)
    if not options.overlap:
        return DoneHandle(h.wait())
    return h
