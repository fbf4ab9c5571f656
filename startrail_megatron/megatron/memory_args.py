"""The checks of StarTrail's memory flags (``--startrail-tiled-loss``, ``--startrail-tiled-mlp``,
``--startrail-attention-tile``, ``--startrail-attention-head-chunks``) against Megatron's
other arguments: ``ValueError`` naming the flag and what is allowed (``arguments.py``'s
``validate_startrail_args`` calls them)."""

from __future__ import annotations

import argparse

from ..schedule import check_head_chunks_setting
from ..schedule.layout import divisors
from ..schedule.ulysses import kv_repeat

__all__ = [
    "autotuner_available",
    "check_attention_tile",
    "check_head_chunks",
    "check_tiled_loss",
    "check_within_local",
]


def check_tiled_loss(args: argparse.Namespace, impl: str) -> None:
    """``--startrail-tiled-loss`` / ``--startrail-tiled-mlp``: a tile within the local
    sequence; under upstream Megatron-LM only with StarTrail on (its hooks put the tiling
    in)."""
    for flag in ("startrail_tiled_loss", "startrail_tiled_mlp"):
        tokens = getattr(args, flag, None)
        if tokens is None:
            continue
        name = "--" + flag.replace("_", "-")
        check_within_local(args, name, tokens, tokens < 1)
        if flag == "startrail_tiled_loss" and getattr(args, "cross_entropy_loss_fusion", False):
            raise ValueError(
                f"{name} replaces the loss, so --cross-entropy-loss-fusion would have no "
                "effect: drop one of them"
            )
        if impl != "startrail" and not autotuner_available(args):
            raise ValueError(
                f"{name} needs --context-parallel-impl startrail under Megatron-LM "
                "(StarTrail's hooks put it into the model; our entry point takes it with either)"
            )


def check_attention_tile(args: argparse.Namespace, impl: str) -> None:
    """``--startrail-attention-tile``: StarTrail's attention only, a tile within the local
    sequence (``ValueError`` naming the flag)."""
    tokens = getattr(args, "startrail_attention_tile", None)
    if tokens is None:
        return
    if impl != "startrail":
        raise ValueError(
            f"--startrail-attention-tile {tokens} cuts StarTrail's attention calls: it needs "
            f"--context-parallel-impl startrail (got {impl})"
        )
    bad = isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
    check_within_local(args, "--startrail-attention-tile", tokens, bad)


def check_head_chunks(args: argparse.Namespace, impl: str) -> None:
    """``--startrail-attention-head-chunks``: StarTrail's attention only, a divisor of the KV
    heads each (TP, ring) rank holds, no attention dropout (``ValueError`` naming the flag)."""
    n = getattr(args, "startrail_attention_head_chunks", None)
    if n is None:
        return
    name = f"--startrail-attention-head-chunks {n}"
    if impl != "startrail":
        raise ValueError(
            f"{name} splits StarTrail's attention: it needs --context-parallel-impl startrail "
            f"(got {impl})"
        )
    check_head_chunks_setting(n)
    heads = getattr(args, "num_attention_heads", None)
    kv = (
        getattr(args, "num_query_groups", None)
        if getattr(args, "group_query_attention", False)
        else heads
    )
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    u = getattr(args, "startrail_ulysses_size", 1) or 1
    if kv and heads:
        kv_tp = kv // tp  # the 2-D split shards them over U, or repeats them up to U
        try:
            ring_kv = kv_tp * kv_repeat(u, heads // tp, kv_tp) // u
        except ValueError:
            ring_kv = None  # U does not fit the heads: the Ulysses check names its flags
        if ring_kv is not None and ring_kv % n:
            allowed = divisors(ring_kv)
            raise ValueError(
                f"{name} must divide the KV heads each rank's attention runs: {kv} KV heads / "
                f"--tensor-model-parallel-size {tp}"
                + (f" / --startrail-ulysses-size {u}" if u > 1 else "")
                + f" = {ring_kv}; allowed: {allowed}"
            )
    if n > 1 and (getattr(args, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(
            f"{name} with --attention-dropout {args.attention_dropout} is not supported yet: "
            "pass --attention-dropout 0 or drop the flag"
        )


def check_within_local(args: argparse.Namespace, name: str, tokens, bad: bool) -> None:
    """A tile flag's ``tokens``: ``ValueError`` naming ``name`` when ``bad`` or when it is
    larger than the local sequence (``--seq-length`` / ``--context-parallel-size``)."""
    cp = getattr(args, "context_parallel_size", 1) or 1
    seq = getattr(args, "seq_length", None)
    local = seq // cp if seq else None
    if bad or (local is not None and tokens > local):
        raise ValueError(
            f"{name} {tokens} must be between 1 and the local sequence, "
            f"--seq-length {seq} / --context-parallel-size {cp} = {local} tokens"
        )


def autotuner_available(args: argparse.Namespace) -> bool:
    """Whether ``args`` come from StarTrail's own entry point, which runs the autotuner."""
    return hasattr(args, "startrail_autotune_iters")
