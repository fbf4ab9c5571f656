"""Activation recompute in the entry point: megatron-core's own, from Megatron-LM's flags.

``add_recompute_args(parser)`` adds ``--recompute-activations``, ``--recompute-granularity``,
``--recompute-method``, ``--recompute-num-layers`` and ``--recompute-modules``;
``validate_recompute(args)`` applies Megatron-LM's rules as ``ValueError``s naming the flag
(and refuses what does not run here); ``recompute_config(args)`` gives the
``TransformerConfig`` fields. A recomputed StarTrail attention runs its forward's transfers
again (the ledger counts them).
"""

from __future__ import annotations

import argparse

from .. import versions

__all__ = ["add_recompute_args", "recompute_config", "validate_recompute"]

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
"""megatron-core's recompute modules of a dense GPT (the MoE and MLA ones need models this
entry point refuses)."""


def add_recompute_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation recompute (megatron-core's, Megatron-LM's flags)")
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="selective recompute (the same as --recompute-granularity selective)",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=RECOMPUTE_GRANULARITIES,
        default=None,
        help="full: recompute whole transformer layers in the backward (needs "
        "--recompute-method and --recompute-num-layers); selective: the submodules of "
        "--recompute-modules. StarTrail's attention, recomputed, communicates again.",
    )
    g.add_argument(
        "--recompute-method",
        choices=RECOMPUTE_METHODS,
        default=None,
        help="with full: uniform (every chunk of --recompute-num-layers layers) or block "
        "(the first --recompute-num-layers layers)",
    )
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument(
        "--recompute-modules",
        nargs="*",
        choices=RECOMPUTE_MODULES,
        default=None,
        help="with selective: the submodules to recompute (default: core_attn)",
    )


def validate_recompute(args: argparse.Namespace) -> None:
    """Megatron-LM's recompute rules (``--recompute-activations`` is selective), as
    ``ValueError``s naming the flag; megatron-core's ``TransformerConfig`` gets the result."""
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ValueError(
                "--recompute-activations is --recompute-granularity selective; "
                "it contradicts --recompute-granularity full"
            )
        args.recompute_granularity = "selective"
    gran, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if gran is None:
        for flag, value in (
            ("--recompute-method", method),
            ("--recompute-num-layers", n),
            ("--recompute-modules", args.recompute_modules),
        ):
            if value is not None:
                raise ValueError(f"{flag} needs --recompute-granularity (full or selective)")
    elif gran == "full":
        if method is None or n is None:
            raise ValueError(
                "--recompute-granularity full needs --recompute-method "
                f"({' or '.join(RECOMPUTE_METHODS)}) and --recompute-num-layers"
            )
        if not 1 <= n <= args.num_layers:
            raise ValueError(
                f"--recompute-num-layers {n} must be between 1 and --num-layers {args.num_layers}"
            )
        if args.recompute_modules is not None:
            raise ValueError(
                "--recompute-modules goes with --recompute-granularity selective; full "
                "recomputes whole layers"
            )
    else:
        if method is not None or n is not None:
            raise ValueError(
                "--recompute-granularity selective takes no --recompute-method nor "
                "--recompute-num-layers (they choose layers for full)"
            )
        if args.recompute_modules == []:
            raise ValueError(
                f"--recompute-modules needs at least one of {', '.join(RECOMPUTE_MODULES)}"
            )
        if "mlp" in (args.recompute_modules or ()):
            # seen on CPU ranks (megatron-core 0.16.1, torch 2.13): the backward recomputes
            # checkpoints inside checkpoints and never ends; not understood, so refused
            raise ValueError(
                "--recompute-modules mlp is not supported yet (megatron-core's MLP recompute "
                "did not finish its backward in our tests); use core_attn, or "
                "--recompute-granularity full"
            )
        if "layernorm" in (args.recompute_modules or ()) and not versions.have_transformer_engine():
            # megatron-core's CheckpointWithoutOutput sets fp8 = (fp8 is not None), True for
            # fp8=False, and then reads Transformer Engine's FP8 state (0.16 and 0.19)
            raise ValueError(
                "--recompute-modules layernorm needs Transformer Engine, which is not "
                "installed (megatron-core's norm recompute reads its FP8 state); use "
                "core_attn and mlp"
            )


def recompute_config(args: argparse.Namespace) -> dict:
    """megatron-core's recompute fields from the flags (validated by ``validate_recompute``): full
    recompute runs whole layers again in the backward (``TransformerBlock``), selective the
    ``recompute_modules`` of each layer (StarTrail's core attention by default); either way
    megatron-core's ``tensor_parallel.checkpoint`` restores the RNG states, so dropout
    draws the same masks again."""
    gran = getattr(args, "recompute_granularity", None)
    if gran is None:
        return {}
    out = {"recompute_granularity": gran}
    if gran == "full":
        out.update(
            recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers
        )
    elif args.recompute_modules is not None:
        out["recompute_modules"] = list(args.recompute_modules)
    return out
