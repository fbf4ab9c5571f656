"""Tiled logits and loss: ``GPTModel``'s output layer and cross-entropy, a sequence tile at a
time, so that the ``[tokens, vocab]`` logits never exist whole.

At long sequences the logits are the largest tensor of a GPT's step (tokens x vocab, in the
model's dtype, and again in fp32 inside the loss), far above any layer's activations. With
``tile_lm_loss(model, tokens)`` the model's loss path computes, for each tile of ``tokens``
sequence positions, that tile's logits and its per-token loss, and keeps neither: the
forward saves only the hidden states (which the layers keep anyway) and the weight; the
backward computes each tile's logits again and runs the tile's backward at once (so a
tile's logits live only inside one step of the loop), accumulating the weight's gradient
in fp32 (a weight tied to the word embedding: straight into Megatron DDP's ``main_grad``,
so the sum is not held through the layers' backward until the embedding's gradient joins
it). The loss is Megatron's own ``vocab_parallel_cross_entropy`` (vocabulary-parallel
under TP: its max, sum and target all-reduces run per tile), the per-token loss is returned
as the untiled path returns it (``[b, s]``), so masks and ``--calculate-per-token-loss``
are unchanged (a model with multi-token prediction is refused: its losses take the same
path, but that is not tested yet). Cost: the output layer's matmul runs once
more in the backward (the logits are recomputed, not kept).

How it is put in: per model instance, ``output_layer.forward`` returns the hidden states
(and remembers the weight it was given: the output weight, or the embedding's when tied)
and ``compute_language_model_loss`` computes the tiled loss from them. A call without
labels (generation) runs the untiled path. DeepSpeed's ``TiledFusedLogitsLoss`` /
``sequence_tiled_compute`` do the same for Hugging Face models; they do not fit here: they
take a loss function over the whole tile and a reduction to a scalar inside, while
megatron-core's model returns per-token losses whose reduction (mask, per-token or mean,
MTP scaling) the training loop does later, and its output layer is vocabulary-parallel.
"""

from __future__ import annotations

import types

from . import versions
from .tiling import TileStats, sequence_tiled

__all__ = ["TileStats", "tile_lm_loss", "tiled_lm_loss"]


def tiled_lm_loss(hidden, weight, labels, tokens, tp_group=None, stats=None, tied=False):
    """Per-token cross-entropy ``[b, s]`` of ``hidden`` [s, b, h] through the output weight
    [V/TP, h] against ``labels`` [b, s], ``tokens`` sequence positions at a time (module
    docstring). ``hidden`` is taken as the output layer takes its input: under TP its
    gradient is all-reduced over ``tp_group`` (``copy_to_tensor_model_parallel_region``).
    ``tied``: ``weight`` is the word embedding's, looked up in the same backward, so its
    tiles' gradients go straight into Megatron DDP's ``main_grad`` where it has one
    (``tiling.sequence_tiled(shared=)``)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    if tokens < 1:
        raise ValueError(f"--startrail-tiled-loss {tokens}: a tile needs at least 1 token")
    hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as Megatron's loss

    def run(h, start):  # one tile's logits and per-token loss, [t, b]
        logits = h.matmul(weight.t())
        return versions.vocab_parallel_cross_entropy(
            logits, labels[start : start + h.shape[0]], tp_group
        )

    stats = stats or TileStats(tokens=tokens)
    if stats.tokens != tokens:
        raise ValueError(
            f"--startrail-tiled-loss {tokens}: the stats count tiles of {stats.tokens}"
        )
    params = [weight] if weight.requires_grad else []
    loss = sequence_tiled(run, stats, hidden, *params, shared=[tied] * len(params))
    return loss.transpose(0, 1).contiguous()


def tile_lm_loss(model, tokens: int) -> TileStats:
    """Make ``model`` (a megatron-core ``GPTModel``, or a wrapper whose ``.module`` chain
    reaches one) compute its logits and loss ``tokens`` sequence positions at a time;
    returns the stats the tiled loss keeps. ``ValueError`` naming the flag for a bad tile."""
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"--startrail-tiled-loss {tokens!r}: give a whole number of tokens >= 1")
    gpt = model
    while not hasattr(gpt, "output_layer") and hasattr(gpt, "module"):
        gpt = gpt.module
    if not hasattr(gpt, "output_layer") or not hasattr(gpt, "compute_language_model_loss"):
        raise ValueError(
            f"--startrail-tiled-loss: {type(model).__name__} has no GPT output layer and loss"
        )
    done = getattr(gpt, "tiled_loss_stats", None)
    if done is not None:  # already tiled (the hooks, then an entry point): the same tiling
        if done.tokens != tokens:
            raise ValueError(
                f"--startrail-tiled-loss {tokens}: the model is tiled at {done.tokens} already"
            )
        return done
    if getattr(gpt, "mtp_process", False):
        raise ValueError(
            "--startrail-tiled-loss with multi-token prediction (--mtp-num-layers) is not "
            "supported yet"
        )
    if getattr(getattr(gpt, "config", None), "cross_entropy_loss_fusion", False):
        raise ValueError(
            "--startrail-tiled-loss replaces the loss, so --cross-entropy-loss-fusion would have "
            "no effect: drop one of them (each tile runs megatron-core's unfused "
            "vocab-parallel cross-entropy)"
        )
    layer = gpt.output_layer
    if getattr(layer, "bias", None) is not None or getattr(layer, "sequence_parallel", False):
        raise ValueError(
            "--startrail-tiled-loss takes an output layer without bias and without sequence "
            "parallelism (Megatron's GPT output layer as this entry point builds it)"
        )
    stats = TileStats(tokens=tokens)
    plain_layer, plain_loss, plain_forward = (
        layer.forward,
        gpt.compute_language_model_loss,
        gpt.forward,
    )
    state = types.SimpleNamespace(weight=None, on=True)
    tp_group = getattr(gpt, "tp_group", None)

    def layer_forward(self, input_, weight=None, runtime_gather_output=None, **kwargs):
        if not state.on:
            return plain_layer(
                input_, weight=weight, runtime_gather_output=runtime_gather_output, **kwargs
            )
        state.weight = self.weight if weight is None else weight
        return input_, None

    def loss(self, labels, logits):
        if not state.on:
            return plain_loss(labels, logits)
        weight, state.weight = state.weight, None
        if weight is None:
            raise RuntimeError("the tiled loss got no output weight from the output layer")
        embedding = getattr(getattr(self, "embedding", None), "word_embeddings", None)
        tied = embedding is not None and weight is getattr(embedding, "weight", None)
        return tiled_lm_loss(logits, weight, labels, tokens, tp_group, stats, tied)

    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        state.on = labels is not None  # without labels the caller wants the logits
        try:
            return plain_forward(*args, **kwargs)
        finally:
            state.on = True

    layer.forward = types.MethodType(layer_forward, layer)
    gpt.compute_language_model_loss = types.MethodType(loss, gpt)
    gpt.forward = types.MethodType(forward, gpt)
    gpt.tiled_loss_stats = stats
    return stats
