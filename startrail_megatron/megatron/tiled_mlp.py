"""Tiled MLP: each transformer layer's MLP a sequence tile at a time, recomputed in the
backward, so that its ``[tokens, ffn]`` intermediates exist for one tile only.

A dense MLP keeps, per token, its ``ffn_hidden_size`` intermediate (twice that with SwiGLU)
for the backward: at long sequences, with the logits (``tiled_loss.py``), the largest
activations of the step. ``tile_mlps(model, tokens)`` makes every layer's MLP run under one
autograd node (``tiling.sequence_tiled``): the forward runs the MLP tile by tile without keeping
anything but its input; the backward runs each tile again with gradients and its backward
at once, so only one tile's intermediates are alive at a time, and sums the parameters'
gradients over the tiles. The MLP itself is megatron-core's, unchanged (SwiGLU, biases, TP:
its row-parallel all-reduce runs per tile, on every TP rank alike). It has no dropout, so
recomputing draws nothing. Cost: the MLP's forward runs once more in the backward.

DeepSpeed's ``TiledMLP`` does the same for a Hugging Face MLP (a module's forward of one
input); it is not used here: megatron-core's MLP returns ``(output, bias)``, takes keyword
arguments per release, and its parameters feed megatron's DDP, which this node hands their
gradients to like any autograd leaf.
"""

from __future__ import annotations

import types

import torch

from .tiling import TileStats, sequence_tiled

__all__ = ["tile_mlps"]


def _tile_one(mlp, tokens: int, stats: TileStats) -> None:
    plain = mlp.forward
    fc2 = mlp.linear_fc2
    # with skip_bias_add the MLP hands fc2's bias back unadded (the layer adds it, with
    # dropout): the same tensor for every tile, passed on as it is
    skipped = fc2.bias if getattr(fc2, "skip_bias_add", False) else None

    def forward(self, hidden_states, *args, **kwargs):
        n = hidden_states.shape[0]
        if n <= tokens:
            return plain(hidden_states, *args, **kwargs)
        if not torch.is_grad_enabled():  # recompute's first pass, evaluation: tiles, no graph
            outs = [
                plain(hidden_states[i : i + tokens], *args, **kwargs)[0]
                for i in range(0, n, tokens)
            ]
            return torch.cat(outs), skipped

        def run(x, start):
            return plain(x, *args, **kwargs)[0]

        params = [p for p in self.parameters() if p.requires_grad and p is not skipped]
        out = sequence_tiled(run, stats, hidden_states, *params)
        return out, skipped

    mlp.forward = types.MethodType(forward, mlp)


def tile_mlps(model, tokens: int) -> TileStats:
    """Tile the MLP of every transformer layer of ``model`` (a megatron-core ``GPTModel`` or
    a wrapper of one) at ``tokens`` sequence positions; returns the stats they keep.
    ``ValueError`` naming the flag for a bad tile or a layer it cannot tile (MoE)."""
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"--startrail-tiled-mlp {tokens!r}: give a whole number of tokens >= 1")
    from megatron.core.transformer.mlp import MLP

    done = getattr(model, "tiled_mlp_stats", None)
    if done is not None:
        if done.tokens != tokens:
            raise ValueError(
                f"--startrail-tiled-mlp {tokens}: the model is tiled at {done.tokens} already"
            )
        return done
    stats = TileStats(tokens=tokens)
    for name, module in model.named_modules():
        mlp = getattr(module, "mlp", None)
        if mlp is None or not hasattr(module, "self_attention"):
            continue
        if type(mlp) is not MLP:
            raise ValueError(
                f"--startrail-tiled-mlp: {name}.mlp is a {type(mlp).__name__}; only megatron-core's "
                "dense MLP is tiled (not MoE)"
            )
        _tile_one(mlp, tokens, stats)
        stats.layers += 1
    if stats.layers == 0:
        raise ValueError(
            f"--startrail-tiled-mlp: {type(model).__name__} has no transformer layer MLP"
        )
    model.tiled_mlp_stats = stats
    return stats
