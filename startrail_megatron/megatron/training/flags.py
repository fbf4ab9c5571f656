"""Megatron-LM's GPT command line: what this entry point honours, ignores or refuses.

Every flag of Megatron-LM's ``pretrain_gpt.py`` (``megatron_lm_flags.txt``: the 681 of
``megatron/training/arguments.py`` at core_r0.16.0) parses here, so a Megatron-LM command
line never stops at "unrecognized arguments":

* honoured: the flags ``arguments.build_parser`` defines, with Megatron-LM's meaning and
  default (``--help`` lists them);
* ignored, with a warning naming the flag: switches that do not change the result here
  (``IGNORED``: kernel fusions, Transformer Engine and overlap switches, extra logging);
* refused, with a ``ValueError`` naming the flag and why: everything else (``REFUSED``
  gives the reason for the common ones; the rest are features this trainer does not
  implement, for which upstream Megatron-LM's own ``pretrain_gpt.py`` through
  ``python -m startrail_megatron.launch`` is the way).

``table()`` prints the three lists (``--megatron-lm-flags``).
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = [
    "DEFAULTS_DIFFER",
    "IGNORED",
    "REFUSED",
    "add_megatron_lm_flags",
    "check_megatron_lm_flags",
    "table",
]

_UPSTREAM = (
    "not implemented by this entry point; run upstream Megatron-LM's pretrain_gpt.py through "
    "python -m startrail_megatron.launch for it"
)

IGNORED: dict[str, str] = {
    # kernel fusions and implementations: the local spec runs plain PyTorch ops
    "--use-flash-attn": "the attention kernel is StarTrail's ($STARTRAIL_KERNEL)",
    "--attention-backend": "the attention kernel is StarTrail's ($STARTRAIL_KERNEL)",
    "--transformer-impl": "this entry point builds the Transformer Engine spec where TE is "
    "installed, else megatron-core's local spec",
    "--use-mcore-models": "megatron-core models are the only ones here",
    "--no-masked-softmax-fusion": "no fused softmax kernel is used",
    "--no-bias-gelu-fusion": "no fused bias-GeLU kernel is used",
    "--no-bias-swiglu-fusion": "no fused bias-SwiGLU kernel is used",
    "--no-bias-dropout-fusion": "no fused bias-dropout kernel is used",
    "--no-rope-fusion": "no fused RoPE kernel is used",
    "--no-gradient-accumulation-fusion": "no fused weight-gradient kernel is used",
    "--no-persist-layer-norm": "no persistent LayerNorm kernel is used",
    "--attention-softmax-in-fp32": "the attention kernels accumulate in fp32 already",
    "--apply-query-key-layer-scaling": "no fp16 softmax here (fp16 is refused)",
    # overlap and memory switches: same mathematics
    "--overlap-grad-reduce": "gradients are reduced after the backward (same result)",
    "--overlap-param-gather": "no distributed optimizer here (same result)",
    "--use-distributed-optimizer": "the optimizer state is kept whole on each rank (same result)",
    "--sequence-parallel": "activations are not split over TP ranks (same result)",
    "--no-async-tensor-model-parallel-allreduce": "same result",
    "--tp-comm-overlap": "same result",
    "--distribute-saved-activations": "recomputed layers keep their whole input on each TP "
    "rank (same result)",
    "--no-create-attention-mask-in-dataloader": "no mask is built: StarTrail reads documents",
    "--num-workers": "batches are read in the training process",
    "--dataloader-type": "single is what runs here (cyclic and external are refused)",
    "--no-mmap-bin-files": "megatron-core maps the .bin files",
    # logging extras
    "--log-throughput": "tokens/s is always logged",
    "--log-timers-to-tensorboard": "no timers",
    "--log-memory-to-tensorboard": "not logged",
    "--log-validation-ppl-to-tensorboard": "the validation loss is logged (ppl = exp(loss))",
    "--log-params-norm": "not logged",
    "--log-num-zeros-in-grad": "not logged",
    "--log-world-size-to-tensorboard": "not logged",
    "--timing-log-level": "no timers",
    "--tensorboard-log-interval": "curves are written every iteration",
    "--wandb-project": "Weights & Biases is not used (use --tensorboard-dir or --log-json)",
    "--wandb-exp-name": "Weights & Biases is not used",
    "--wandb-save-dir": "Weights & Biases is not used",
    "--ckpt-format": "checkpoints are megatron-core's distributed format (torch_dist)",
    "--async-save": "checkpoints are saved synchronously",
}

REFUSED: dict[str, str] = {
    "--fp16": "fp16 needs a loss scaler this trainer does not have: use --bf16",
    "--fp8-format": "fp8 needs Transformer Engine on GPUs: " + _UPSTREAM,
    "--train-samples": "sample-based training: give --train-iters",
    "--lr-decay-samples": "sample-based schedule: give --lr-decay-iters",
    "--lr-warmup-samples": "sample-based schedule: give --lr-warmup-iters or --lr-warmup-fraction",
    "--lr-wsd-decay-samples": "sample-based schedule: give --lr-wsd-decay-iters",
    "--rampup-batch-size": "batch-size ramp-up: " + _UPSTREAM,
    "--vocab-file": "GPT-2 BPE files: use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR",
    "--merge-file": "GPT-2 BPE files: use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR",
    "--train-data-path": "per-split data: give --data-path with --split",
    "--valid-data-path": "per-split data: give --data-path with --split",
    "--test-data-path": "per-split data: give --data-path with --split",
    "--data-args-path": "give --data-path (weights and prefixes) instead",
    "--per-split-data-args-path": "give --data-path with --split instead",
    "--num-experts": "mixture of experts: " + _UPSTREAM,
    "--num-layers-per-virtual-pipeline-stage": "pipeline parallelism: " + _UPSTREAM,
    "--use-checkpoint-args": "give the model flags explicitly",
    "--exit-signal-handler": "Ctrl-C (SIGINT) already saves (with --save) and exits cleanly",
    "--finetune": _UPSTREAM,
    "--no-save-optim": _UPSTREAM,
    "--spec": "this entry point builds its own layer spec",
    "--yaml-cfg": "give the flags on the command line",
}


DEFAULTS_DIFFER: dict[str, str] = {
    "--num-layers, --hidden-size, --num-attention-heads, --seq-length, --micro-batch-size, "
    "--train-iters, --lr": "small demo values here; Megatron-LM requires them",
    "--attention-dropout, --hidden-dropout": "0.0 here; 0.1 in Megatron-LM",
    "--position-embedding-type": "rope here; learned_absolute in Megatron-LM",
    "--log-interval": "1 here; 100 in Megatron-LM",
    "--bf16": "on CPU ranks the bf16 weights are updated directly (no fp32 master copy; "
    "megatron-core's optimizer on GPUs keeps one, as Megatron-LM)",
    "--calculate-per-token-loss": "always on here: the loss is the mean over the global "
    "batch's unmasked tokens; Megatron-LM's default (flag off) averages each micro-batch's "
    "mean, which differs when loss masks are uneven (--eod-mask-loss)",
}
"""Honoured flags whose default (or only mode) is not Megatron-LM's: say so, never hide it."""


def _megatron_lm_flags() -> dict[str, str]:
    """Megatron-LM's flags and their arity (``megatron_lm_flags.txt``)."""
    path = os.path.join(os.path.dirname(__file__), "megatron_lm_flags.txt")
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, kind = line.split()
                out[name] = kind
    return out


def add_megatron_lm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every Megatron-LM flag the parser does not define yet, hidden from ``--help``,
    without a default (present on the namespace only when given)."""
    known = {s for a in parser._actions for s in a.option_strings}
    for name, kind in sorted(_megatron_lm_flags().items()):
        if name in known:
            continue
        kw: dict = {"default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if kind == "flag":
            kw["action"] = "store_true"
        elif kind == "list":
            kw["nargs"] = "*"
        elif kind != "1":
            kw["nargs"] = int(kind)
        parser.add_argument(name, dest=f"_mlm_{name[2:]}", **kw)  # the name, verbatim


def check_megatron_lm_flags(args: argparse.Namespace, warn=None) -> list[str]:
    """Warn about each ignored flag given (returned); ``ValueError`` naming the first
    refused one given, with the reason."""
    given = ["--" + k[len("_mlm_") :] for k in vars(args) if k.startswith("_mlm_")]
    for name in sorted(given):
        if name == "--dataloader-type" and getattr(args, "_mlm_dataloader-type") != "single":
            raise ValueError(
                f"Megatron-LM's --dataloader-type {getattr(args, '_mlm_dataloader-type')} is "
                "refused here: only single (a sequential sampler) is implemented"
            )
        if name not in IGNORED:
            raise ValueError(
                f"Megatron-LM's {name} is refused here: {REFUSED.get(name, _UPSTREAM)}"
            )
    ignored = sorted(given)
    for name in ignored:
        msg = f"Megatron-LM's {name} is accepted and ignored here: {IGNORED[name]}"
        (warn or (lambda m: print(f"WARNING: {m}", file=sys.stderr, flush=True)))(msg)
    return ignored


def table(parser: argparse.ArgumentParser) -> str:
    """The honoured / ignored / refused lists, for ``--megatron-lm-flags`` and the README."""
    mlm = _megatron_lm_flags()
    ours = sorted(
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--")
    )
    honoured = [s for s in ours if s in mlm]
    extra = [s for s in ours if s not in mlm and s != "--help"]
    lines = [f"Honoured with Megatron-LM's meaning and default ({len(honoured)}):"]
    lines += [f"  {s}" for s in honoured]
    lines += ["  whose default or only mode differs from Megatron-LM's:"]
    lines += [f"    {k}: {v}" for k, v in DEFAULTS_DIFFER.items()]
    lines += [f"Added by this entry point ({len(extra)}):"] + [f"  {s}" for s in extra]
    lines += [f"Accepted and ignored, with a warning ({len(IGNORED)}):"]
    lines += [f"  {k}: {v}" for k, v in sorted(IGNORED.items())]
    rest = len(mlm) - len(honoured) - len([k for k in IGNORED if k in mlm])
    lines += [f"Refused by name ({rest} in all; the reasons given for these):"]
    lines += [f"  {k}: {v}" for k, v in sorted(REFUSED.items())]
    lines.append(f"  every other Megatron-LM flag: {_UPSTREAM}")
    return "\n".join(lines)
