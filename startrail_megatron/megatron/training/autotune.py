"""``--startrail-team-size auto``: pick (C, placement) by timing each on the real ranks."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from ...planner.autotune import autotune, startrail_candidates
from .. import rng
from ..arguments import own_rows_first_arg
from ..registry import create_startrail_groups, release_startrail_groups
from .data import build_dataset, global_batches
from .step import forward_backward, rank_device

__all__ = ["autotune_team_size"]


def autotune_team_size(args: argparse.Namespace, model, log=print) -> list[str]:
    """``--startrail-team-size auto``: time each valid (C, placement), keep the fastest.

    The paper's scheduler (sec. 4.4): every candidate runs a warm-up and
    ``--startrail-autotune-iters`` forward-backward passes of the first batch
    (gradients discarded, weights untouched, the generators' states restored after: with
    dropout the run then draws what it would with a fixed C); times are reduced with MAX over
    all ranks so every rank picks the same. Sets ``args.startrail_team_size`` and
    ``args.startrail_placement`` and leaves the chosen groups installed.
    """
    from megatron.core import parallel_state

    cp_group = parallel_state.get_context_parallel_group()
    orf = own_rows_first_arg(args)
    tile = getattr(args, "startrail_attention_tile", None)
    chunks = getattr(args, "startrail_attention_head_chunks", None)
    sample = next(global_batches(args, build_dataset(args, args.global_batch_size)))
    lines: list[str] = []

    def say(msg: str) -> None:
        lines.append(msg)
        if log is not None and dist.get_rank() == 0:
            log(msg)

    def run_trial(cand) -> list[float]:
        release_startrail_groups(cp_group)  # the previous candidate's communicators
        create_startrail_groups(
            cp_group, cand.team_size, cand.placement, own_rows_first=orf, attention_tile=tile,
            attention_head_chunks=chunks,
        )  # fmt: skip
        times = []
        for i in range(args.startrail_autotune_iters + 1):
            t0 = time.perf_counter()
            forward_backward(args, model, sample)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=rank_device())
            model.zero_grad_buffer()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:
                times.append(t.item())
        return times

    # catch=(): a failure on one rank must not let the ranks choose differently.
    before = rng.capture()  # the trials' dropout must not move the run's draws
    result = autotune(
        startrail_candidates(args.context_parallel_size), run_trial, log=say, catch=()
    )
    rng.restore(before)
    best = result.best
    release_startrail_groups(cp_group)
    create_startrail_groups(
        cp_group, best.team_size, best.placement, own_rows_first=orf, attention_tile=tile,
        attention_head_chunks=chunks,
    )  # fmt: skip
    args.startrail_team_size, args.startrail_placement = best.team_size, best.placement
    return lines
