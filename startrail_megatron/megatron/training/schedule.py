"""The learning-rate and weight-decay schedule: megatron-core's ``OptimizerParamScheduler``
set up exactly as Megatron-LM's ``get_optimizer_param_scheduler`` does for iteration-based
training (steps counted in samples: ``iterations x global batch``), stepped by the global
batch after every update. It writes ``lr`` and ``weight_decay`` into the optimizer's param
groups (torch's optimizers on CPU ranks, megatron's on GPUs)."""

from __future__ import annotations

import argparse

__all__ = ["build_scheduler"]


def build_scheduler(args: argparse.Namespace, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    decay = args.lr_decay_iters * gbs
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    else:
        warmup = args.lr_warmup_iters * gbs
    wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
