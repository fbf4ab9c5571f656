"""The training loop: ``train(args)`` on an initialized process group, with its log.

As Megatron-LM's: the learning-rate schedule stepped after every update, evaluation on the
validation split every ``--eval-interval`` iterations (``--eval-iters`` global batches,
their per-token mean losses averaged) and on the test split once after training, a printed
line every ``--log-interval`` iterations (its loss and time the means over them), a
checkpoint every ``--save-interval`` and at the
end, ``--exit-interval`` / ``--exit-duration-in-mins``, curves to ``--tensorboard-dir``
and/or ``--log-json``. Each logged iteration shows the loss, the learning rate, tokens/s,
the time left and, with StarTrail, the bytes it moved (P2P and team collectives, from the
ledger) against ring attention's. Ctrl-C (SIGINT) stops at the end of the iteration in
progress on every rank, saves with ``--save`` and returns the log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time

import torch
import torch.distributed as dist

from ...accounting import LocalShape, startrail_comm_bytes
from ...bench.memory import PHASES, PeakMemory, phase_hooks
from ...schedule.layout import StarTrailLayout
from ..registry import get_startrail_state, hybrid_states
from .autotune import autotune_team_size
from .checkpoint import load_checkpoint, save_checkpoint
from .data import build_datasets, global_batches
from .initialize import initialize, teardown
from .model import build_model, build_optimizer
from .schedule import build_scheduler
from .step import forward_backward, optimizer_step, rank_device

__all__ = ["train"]


def _startrail_bytes(args) -> dict:
    """StarTrail's bytes in the last iteration, summed over the CP group (with
    ``--hybrid-context-parallel``: over every sub-group of the DP x CP ranks), and ring's
    on the same groups (and the attention calls that ran attention dropout).

    Measured from the ledger; ring attention's figure is the accounting's for C = 1 at the
    same shapes: each attention call's local length, as recorded by the attention (the
    tests check the accounting against ledgers), every sub-ring step sent (as ring
    attention without window-aware skipping sends; under a narrow window StarTrail skips
    idle steps, ``schedule.startrail_active_steps``).
    """
    from megatron.core import parallel_state

    cp_group = parallel_state.get_context_parallel_group()
    states = [get_startrail_state(cp_group)]
    if getattr(args, "hybrid_context_parallel", False):  # and every sub-group's, summed
        states += list(hybrid_states().values())
        cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    figures = torch.zeros(4, dtype=torch.float64, device=rank_device())
    for state in {id(s): s for s in states}.values():
        led, lay = state.ledger, state.groups.layout
        ring_lay, rank = StarTrailLayout(lay.cp_size, 1), state.groups.cp_rank
        ring_p2p = 0
        for s_local, calls in state.calls_by_length.items():  # packed batches vary in length
            shape = LocalShape(
                s_local=s_local,
                batch=args.micro_batch_size if not args.reset_attention_mask else 1,
                heads_q=args.num_attention_heads // args.tensor_model_parallel_size,
                heads_kv=max(args.num_query_groups // args.tensor_model_parallel_size, 1),
                head_dim=args.hidden_size // args.num_attention_heads,
                elem_bytes=2 if args.bf16 else 4,
            )
            ring = startrail_comm_bytes(ring_lay, rank, shape)
            ring_p2p += (ring["fwd_p2p"] + ring["bwd_p2p"]) * calls
        figures += torch.tensor(
            [led.bytes("p2p"), led.bytes("collective"), ring_p2p, state.dropout_calls],
            dtype=torch.float64,
            device=rank_device(),
        )
        led.clear()
        state.calls_by_length.clear()
        state.dropout_calls = 0
    dist.all_reduce(figures, group=cp_group)
    return {
        "p2p": figures[0].item(),
        "collective": figures[1].item(),
        "ring_p2p": figures[2].item(),
        "dropout_calls": int(figures[3].item()),
    }


def train(args: argparse.Namespace) -> list[dict]:
    """Run the training loop on an initialized process group; returns the log."""
    t_called = time.perf_counter()  # --exit-duration-in-mins counts the set-up too
    initialize(args)
    rank = dist.get_rank()
    stop = _StopFlag()
    writer = None
    try:
        model = build_model(args)
        optimizer = build_optimizer(args, model)
        # under hybrid CP ``auto`` is the cost model's pick per sub-group size (initialize)
        if (
            args.context_parallel_impl == "startrail"
            and args.startrail_team_size == "auto"
            and not args.hybrid_context_parallel
        ):
            autotune_team_size(args, model)
        start = 0
        if args.load:
            start = load_checkpoint(
                args.load,
                model,
                None if args.no_load_optim else optimizer,
                args.ckpt_step,
                load_rng=not args.no_load_rng,
                global_batch_size=args.global_batch_size,
            )
            if start > args.train_iters:  # the loop would not run, and the save relabel it
                raise ValueError(
                    f"--load {args.load}: its checkpoint is of iteration {start}, past "
                    f"--train-iters {args.train_iters}; give --train-iters above {start} (or "
                    f"--ckpt-step N <= {args.train_iters})"
                )
        scheduler = build_scheduler(args, optimizer)
        scheduler.step(start * args.global_batch_size)  # resumed: the same schedule
        train_ds, valid_ds, test_ds = build_datasets(args)
        batches = global_batches(args, train_ds, start)
        valid = None
        if valid_ds is not None:  # resumed: the validation batches continue where they were
            done = start // args.eval_interval * args.eval_iters
            valid = global_batches(args, valid_ds, done)
        writer = _writer(args, rank)
        log: list[dict] = []
        since_print: list[dict] = []  # the iterations a printed line averages
        t_start = time.perf_counter()
        for it in range(start + 1, args.train_iters + 1):
            t0 = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            with _peak_memory(args, model) as mem:
                loss = forward_backward(args, model, next(batches))
                grad_norm = optimizer_step(model, optimizer, args.clip_grad)
            scheduler.step(args.global_batch_size)
            dt = time.perf_counter() - t0
            entry = {
                "iteration": it,
                "loss": loss,
                "lr": lr,
                "seconds": dt,
                "tokens_per_s": args.global_batch_size * args.seq_length / dt,
            }
            if grad_norm is not None:
                entry["grad_norm"] = grad_norm
            if mem is not None:
                entry.update(_largest_rank_peaks(mem))
            if args.context_parallel_impl == "startrail":
                entry["startrail"] = _startrail_bytes(args)
            if valid is not None and (it % args.eval_interval == 0 or it == args.train_iters):
                entry["val_loss"] = evaluate(args, model, valid)
                if args.context_parallel_impl == "startrail":
                    _startrail_bytes(args)  # the evaluation's transfers are not the step's
            elapsed = time.perf_counter() - t_start
            entry["seconds_left"] = elapsed / (it - start) * (args.train_iters - it)
            log.append(entry)
            since_print.append(entry)
            if writer is not None:
                _write_curves(writer, entry)
            if it % args.log_interval == 0 or it == args.train_iters or "val_loss" in entry:
                if rank == 0:
                    _print_iteration(args, _interval_mean(since_print))
                since_print = []
            saved = False
            if args.save and args.save_interval and it % args.save_interval == 0:
                save_checkpoint(args.save, model, it, optimizer, args.global_batch_size)
                saved = True
            why = _why_stop(args, it, time.perf_counter() - t_called, stop)
            if why:
                if rank == 0:
                    print(f" stopping after iteration {it}: {why}", flush=True)
                if args.save and not saved:
                    save_checkpoint(args.save, model, it, optimizer, args.global_batch_size)
                break
        else:
            if test_ds is not None and log:  # as Megatron-LM: once, after training
                log[-1]["test_loss"] = evaluate(args, model, global_batches(args, test_ds))
                if rank == 0:
                    print(f" test loss {log[-1]['test_loss']:.6f} (--eval-iters batches of the "
                          "test split)", flush=True)  # fmt: skip
            last_saved = args.save_interval and args.train_iters % args.save_interval == 0
            if args.save and start < args.train_iters and not last_saved:
                save_checkpoint(
                    args.save, model, args.train_iters, optimizer, args.global_batch_size
                )
        if rank == 0 and args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(log, f, indent=1)
        return log
    finally:
        stop.restore()
        if writer is not None:
            writer.close()
        teardown()


@contextlib.contextmanager
def _peak_memory(args, model):
    """The iteration's peak memory on this rank (``--log-peak-memory``), or None; with
    ``live``, also the peaks inside the transformer layers (the decoder's forward and
    backward) and outside them (``bench.memory.phase_hooks``)."""
    if not getattr(args, "log_peak_memory", None):
        yield None
        return
    method = args.log_peak_memory
    if method == "auto":
        method = "cuda" if torch.cuda.is_available() else "live"
    handles = []
    try:
        with PeakMemory(rank_device(), method, whole=True) as mem:
            if method == "live":
                handles = phase_hooks(model.module.decoder, mem.tracker, PHASES[0])
            yield mem
    finally:
        for h in handles:
            h.remove()


def _largest_rank_peaks(mem) -> dict:
    """The iteration's peak and its phases' (``live`` only), each the largest rank's, in one
    all-reduce of a fixed-length vector (a phase a rank lacks is -1 there, so the ranks'
    calls always match)."""
    phases = getattr(getattr(mem, "tracker", None), "phase_peaks", {})
    values = [float(mem.peak)] + [float(phases.get(n, -1)) for n in PHASES]
    t = torch.tensor(values, dtype=torch.float64, device=rank_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = {"peak_memory": t[0].item()}
    out.update({f"peak_memory_{n}": v.item() for n, v in zip(PHASES, t[1:]) if v >= 0})
    return out


def evaluate(args: argparse.Namespace, model, valid) -> float:
    """The validation loss over ``--eval-iters`` global batches, weighted by their tokens
    (Megatron-LM's: total loss / total unmasked tokens), without dropout or gradients."""
    model.eval()
    try:
        parts = [
            forward_backward(args, model, next(valid), backward=False, return_tokens=True)
            for _ in range(args.eval_iters)
        ]
    finally:
        model.train()
    return sum(m * n for m, n in parts) / sum(n for _, n in parts)


class _StopFlag:
    """Ctrl-C sets a flag (the first time; a second Ctrl-C interrupts at once); the ranks
    agree on it at the end of each iteration."""

    def __init__(self):
        self.set = False
        self._prev = None
        try:
            self._prev = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: no handler
            self._prev = None

    def _handler(self, signum, frame):
        if self.set:
            raise KeyboardInterrupt
        self.set = True

    def restore(self) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)


def _why_stop(args, it: int, elapsed_s: float, stop: _StopFlag) -> str | None:
    """Why every rank stops after iteration ``it`` (one all-reduce: any rank's Ctrl-C or
    clock), or None."""
    if args.exit_interval and it % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval}"
    flags = torch.tensor(
        [float(stop.set), elapsed_s / 60.0], dtype=torch.float64, device=rank_device()
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0].item():
        return "interrupted (Ctrl-C)" + (", saving" if args.save else "")
    if args.exit_duration_in_mins is not None and flags[1].item() > args.exit_duration_in_mins:
        return f"--exit-duration-in-mins {args.exit_duration_in_mins}"
    return None


def _writer(args, rank: int):
    """TensorBoard on the last rank, as Megatron-LM (``--tensorboard-dir``)."""
    if args.tensorboard_dir is None or rank != dist.get_world_size() - 1:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=args.tensorboard_dir)


def _write_curves(writer, e: dict) -> None:
    it = e["iteration"]
    writer.add_scalar("lm loss", e["loss"], it)
    writer.add_scalar("learning-rate", e["lr"], it)
    writer.add_scalar("tokens-per-second", e["tokens_per_s"], it)
    if "val_loss" in e:
        writer.add_scalar("lm loss validation", e["val_loss"], it)


def _interval_mean(entries: list[dict]) -> dict:
    """The last entry, its loss and time the means over ``entries`` (the iterations since
    the last printed line: Megatron-LM's ``lm loss`` and time per iteration are those)."""
    out = dict(entries[-1])
    out["loss"] = sum(e["loss"] for e in entries) / len(entries)
    out["seconds"] = sum(e["seconds"] for e in entries) / len(entries)
    out["tokens_per_s"] = entries[-1]["tokens_per_s"] * entries[-1]["seconds"] / out["seconds"]
    return out


def _print_iteration(args, e: dict) -> None:
    width = len(str(args.train_iters))
    line = (
        f" iteration {e['iteration']:>{width}}/{args.train_iters} | lm loss {e['loss']:.6f} | "
        f"lr {e['lr']:.3e} | {e['seconds'] * 1000:7.1f} ms | {e['tokens_per_s']:8.0f} tokens/s"
        f" | {_hms(e['seconds_left'])} left"
    )
    if "val_loss" in e:
        line += f" | validation loss {e['val_loss']:.6f}"
    if "peak_memory" in e:
        line += f" | peak memory {e['peak_memory'] / 2**20:.1f} MiB"
    st = e.get("startrail")
    if st:
        saved = 1 - st["p2p"] / st["ring_p2p"] if st["ring_p2p"] else 0.0
        line += (
            f" | StarTrail P2P {st['p2p'] / 1e6:.2f} MB vs ring {st['ring_p2p'] / 1e6:.2f} MB "
            f"({saved:.0%} less), collectives {st['collective'] / 1e6:.2f} MB (CP group)"
        )
    print(line, flush=True)


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
