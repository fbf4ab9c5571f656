"""All CP ranks in one process: the StarTrail schedule on one device, no torch.distributed.

``one_process_attention(q_shards, k_shards, v_shards, team_size)`` runs every
rank's forward (and, through autograd, backward) of ``rank/`` on one
device, in one process: the team collectives and sub-ring P2P exchanges are
the in-process transport (``comm/in_process.py``: tensor copies between ranks
run as cooperative threads, one at a time). It exists to check and time the
full algorithm with GPU kernels on one GPU (``scripts/gpu_check.sh``), and
outputs are bitwise those of a real multi-rank run
(``tests/test_one_process.py`` compares with gloo ranks).

Design: the algorithm is not duplicated. The public per-rank
``startrail_rank_forward`` / ``startrail_rank_backward`` run unchanged for each
rank; only the two transports of its ``RankCall`` differ. A rank's compute
is timed by the segments it runs outside communication (``RankTimer``). Why
threads rather than rewriting the schedule as generators: the per-rank code
keeps its straight-line form, shared with the multi-rank path. The autograd
graph is one node over all ranks (``_OneProcess``), so the engine's per-device
backward thread never blocks on a peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .comm import CommLedger, CommOptions
from .comm.in_process import Baton, InProcessP2P, InProcessTeam, InProcessWorld
from .kernels import AttentionKernel, resolve_kernel
from .rank import RankCall, startrail_rank_backward, startrail_rank_forward
from .schedule.layout import Placement, StarTrailLayout
from .validation import (
    check_comm_options,
    check_options,
    first_order_only,
    packed_layout,
    validate_inputs,
)

__all__ = ["RankTimer", "one_process_attention"]


class RankTimer:
    """Compute time of each rank, excluding its communication and waiting, and the
    compute each transfer could hide behind.

    On CUDA, events recorded on the current stream bound each segment (read
    after one synchronize in ``totals``); elsewhere ``time.perf_counter``. Every
    transfer of the in-process transport reports which of its rank's compute
    segments ran between its issue and its wait (``transfer``); ``overlap`` turns
    that window into the fraction of the transfer a link of a given speed would hide
    (one process runs the ranks in turn, so a wait's wall time means nothing here).
    """

    def __init__(self, world_size: int, device: torch.device | str = "cpu"):
        self.world_size = world_size
        self.device = torch.device(device)
        self._open: dict[int, Any] = {}
        self._segments: list[list[tuple[Any, Any]]] = [[] for _ in range(world_size)]
        self._transfers: list[tuple] = []

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

    def closed(self, rank: int) -> int:
        """Compute segments ``rank`` has closed so far."""
        return len(self._segments[rank])

    def transfer(
        self, rank: int, phase: str, kind: str, what: str, nbytes: int, first: int, last: int
    ) -> None:
        """A transfer of ``rank`` was in flight during its segments ``first .. last-1``."""
        self._transfers.append((rank, phase, kind, what, nbytes, first, last))

    def _durations(self) -> list[list[float]]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [[a.elapsed_time(b) / 1e3 for a, b in seg] for seg in self._segments]
        return [[b - a for a, b in seg] for seg in self._segments]

    def totals(self) -> list[float]:
        """Seconds of compute per rank since the last ``reset``."""
        return [sum(d) for d in self._durations()]

    def overlap(self, link_bytes_per_s: float) -> list[dict[str, dict[str, float]]]:
        """Per rank, per ``"phase/kind/what"``: transfers, bytes, ``window_s`` (the rank's
        compute between each issue and its wait, summed), ``transfer_s`` (the bytes at
        ``link_bytes_per_s``) and ``hidden``, the fraction of ``transfer_s`` those windows
        cover (each transfer hidden up to its own window)."""
        if not link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s={link_bytes_per_s!r} must be > 0")
        dur = self._durations()
        out: list[dict[str, dict[str, float]]] = [{} for _ in range(self.world_size)]
        for rank, phase, kind, what, nb, first, last in self._transfers:
            window = sum(dur[rank][first:last])
            t = nb / link_bytes_per_s
            row = out[rank].setdefault(
                f"{phase}/{kind}/{what}",
                {"count": 0, "bytes": 0, "window_s": 0.0, "transfer_s": 0.0, "hidden_s": 0.0},
            )
            row["count"] += 1
            row["bytes"] += nb
            row["window_s"] += window
            row["transfer_s"] += t
            row["hidden_s"] += min(window, t)
        for per_rank in out:
            for row in per_rank.values():
                row["hidden"] = row["hidden_s"] / row["transfer_s"] if row["transfer_s"] else 1.0
        return out

    def reset(self) -> None:
        self._open.clear()
        self._segments = [[] for _ in range(self.world_size)]
        self._transfers = []


class _OneProcess(torch.autograd.Function):
    """One autograd node for all ranks: forward and backward each run every rank."""

    @staticmethod
    def forward(ctx, run: dict, sinks, *tensors):
        p = run["layout"].cp_size
        qs, ks, vs = tensors[:p], tensors[p : 2 * p], tensors[2 * p :]
        world = InProcessWorld(run["layout"])
        world.baton = Baton(p, qs[0].device, run["timer"])
        ledgers = run["ledgers"]
        calls: list[Any] = [None] * p

        def rank_fn(r: int) -> Callable[[], Any]:
            def fn():
                led = ledgers[r]
                if led is not None:
                    led.phase = "fwd"
                rc = RankCall(
                    layout=run["layout"], rank=r, causal=run["causal"],
                    team_comm=InProcessTeam(world, r, led), p2p=InProcessP2P(world, r, led),
                    packed=run["packed"], options=run["options"],
                    own_rows_first=run["comm"].own_rows_first,
                )  # fmt: skip
                out, saved = startrail_rank_forward(
                    qs[r], ks[r], vs[r], rc, run["scale"], run["kernel"], sinks
                )
                return out, saved, rc

            return fn

        results = world.baton.run([rank_fn(r) for r in range(p)])
        flat = []
        for r, (out, saved, rc) in enumerate(results):
            calls[r] = rc
            flat += [out, *saved]
        ctx.save_for_backward(*flat)
        ctx.run, ctx.calls, ctx.world, ctx.sinks = run, calls, world, sinks
        return tuple(res[0] for res in results)

    @staticmethod
    @first_order_only("one_process_attention")
    def backward(ctx, *douts):
        run, calls, world = ctx.run, ctx.calls, ctx.world
        p = run["layout"].cp_size
        saved = ctx.saved_tensors
        world.baton = Baton(p, douts[0].device, run["timer"])
        world.phase = "bwd"

        def rank_fn(r: int) -> Callable[[], Any]:
            def fn():
                out, q_team, kv_local, lse_team = saved[4 * r : 4 * r + 4]
                led = run["ledgers"][r]
                if led is not None:
                    led.phase = "bwd"
                return startrail_rank_backward(
                    douts[r].contiguous(),
                    out,
                    (q_team, kv_local, lse_team),
                    calls[r],
                    run["scale"],
                    run["kernel"],
                    ctx.sinks,
                )

            return fn

        grads = world.baton.run([rank_fn(r) for r in range(p)])
        d_sinks = None
        if ctx.sinks is not None:  # every rank's part: the whole gradient
            d_sinks = sum(g.sinks for g in grads).to(ctx.sinks.dtype)
        return (
            None, d_sinks, *(g.dq for g in grads), *(g.dk for g in grads), *(g.dv for g in grads),
        )  # fmt: skip


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
    cu_seqlens=None,
    cu_seqlens_padded=None,
    dropout_p: float = 0.0,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    own_rows_first: bool | None = None,
    tile: int | None = None,
) -> list[Tensor]:
    """StarTrail over ``P = len(q_shards)`` CP ranks, all run in this process.

    Args:
        q_shards, k_shards, v_shards: rank r's local ``[s_local, b, h, d]``
            tensors (``zigzag_shard`` of the full sequence for causal), all on
            one device; differentiable.
        team_size: C, with C*C dividing P.
        placement, causal, softmax_scale, kernel, cu_seqlens, cu_seqlens_padded,
            dropout_p, window, softcap, sinks, tile: as ``startrail_attention`` (the ranks draw
            their dropout masks in turn from the one default generator; the sinks receive
            the whole gradient, every rank's part summed).
        ledgers: one ``CommLedger`` (or ``None``) per rank; each records what
            that rank would send, exactly as in a multi-rank run.
        timer: a ``RankTimer`` that accumulates each rank's compute time.
        own_rows_first: as ``CommOptions(own_rows_first=)`` (``None``: one host, so
            ``$STARTRAIL_OWN_ROWS_FIRST`` where set, else the step kept whole).

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
    packed = packed_layout(p, q0.shape[0], cu_seqlens, cu_seqlens_padded)
    options = check_options(q0, p, causal, dropout_p, window, softcap, sinks, tile)
    kernel, scale = resolve_kernel(q0, kernel, softmax_scale, **options.kernel_needs)
    comm = check_comm_options(CommOptions(own_rows_first=own_rows_first), q0)
    run = dict(
        comm=comm,
        layout=layout,
        packed=packed,
        options=options,
        causal=bool(causal),
        scale=scale,
        kernel=kernel,
        ledgers=list(ledgers),
        timer=timer,
    )
    return list(_OneProcess.apply(run, sinks, *q_shards, *k_shards, *v_shards))
