"""Tiled logits and loss for transformers causal LMs: ``"startrail": {"tiled_loss": TOKENS}``.

The output layer and the cross-entropy run one sequence shard of at most TOKENS local tokens
at a time, so the ``[tokens, vocab]`` logits (and their fp32 upcast and gradient) exist for
one shard only. The computation is DeepSpeed's own ``sequence_tiled_compute``
(``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, ALST, arXiv 2506.13996): each shard's
loss without a graph in the forward, each shard recomputed with gradients in the backward,
``lm_head``'s gradient held back from ZeRO until the last shard (``ds_grad_is_ready``).
DeepSpeed's ``TiledFusedLogitsLoss`` (backward inside the forward, no recompute) does not
fit: it writes ``lm_head``'s weight gradient during the forward as if the loss's incoming
gradient were 1 and scales only the hidden states' gradient by the real one, which this
adapter's replica loss, ZeRO-3's ``grad_scale``, gradient accumulation and fp16 loss scaling
all change: the weight gradient would be silently wrong.

How it plugs in without model-code changes: transformers' causal LMs compute
``logits = self.lm_head(hidden)`` and then ``self.loss_function(logits=logits, labels=...)``.
While a forward with labels runs, ``lm_head`` returns ``DeferredLogits``, a tensor holding
only the hidden states and the shape the logits would have; ``loss_function`` (ours) computes
the tiled loss from it, calling ``lm_head`` itself on each shard (so ZeRO-3 gathers its
weight as for any call). Anything else that touches the deferred logits (a model that
scales or soft-caps them before the loss, user code reading ``output.logits``) raises
naming ``startrail.tiled_loss``: the logits were never made. Without labels (evaluation
that wants logits, generation) ``lm_head`` runs as usual.

The loss is transformers' ``ForCausalLMLoss`` on ``shift_labels``: the sum of the shard's
token losses over ``num_items_in_batch`` (this adapter always passes it; without it, the
mean over this rank's valid tokens), ``ignore_index`` -100; in fp32 as transformers upcasts.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

__all__ = ["DeferredLogits", "TiledLossStats", "check_hf_loss", "tile_hf_loss"]

_METADATA = {
    Tensor.shape.__get__,
    Tensor.dtype.__get__,
    Tensor.device.__get__,
    Tensor.requires_grad.__get__,
    Tensor.grad_fn.__get__,
    Tensor.is_leaf.__get__,
    Tensor.ndim.__get__,
    Tensor.layout.__get__,
    Tensor.size,
    Tensor.dim,
    Tensor.is_floating_point,
    Tensor.__repr__,
    Tensor.__format__,
}


class DeferredLogits(Tensor):
    """The logits ``lm_head`` would have made, not made: shape, dtype and device only, and the
    hidden states to compute them from a shard at a time. Any use but the tiled loss raises
    ``NotImplementedError`` naming ``startrail.tiled_loss`` (metadata reads are allowed, and
    ``detach``, which DeepSpeed's module hooks apply to every module output)."""

    hidden: Tensor
    lm_head: nn.Module
    owner: str

    @staticmethod
    def __new__(cls, hidden: Tensor, lm_head: nn.Module, vocab: int, owner: str):
        shape = (*hidden.shape[:-1], vocab)
        out = Tensor._make_wrapper_subclass(
            cls, shape, dtype=hidden.dtype, device=hidden.device, requires_grad=False
        )
        out.hidden, out.lm_head, out.owner = hidden, lm_head, owner
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}: never made)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is Tensor.detach:  # ZeRO's module hooks detach every module output
            self = args[0]
            return DeferredLogits(self.hidden, self.lm_head, self.shape[-1], self.owner)
        owner = next(
            (a.owner for a in tree_leaves((args, kwargs)) if isinstance(a, DeferredLogits)), "?"
        )
        name = getattr(func, "__name__", repr(func))
        raise NotImplementedError(
            f"startrail.tiled_loss: {owner}'s logits are never made with the tiled loss on (the "
            f"loss is computed a sequence shard at a time), but something used them ({name}): "
            "a model that transforms its logits before the loss (soft-capping, scaling) or code "
            "reading output.logits cannot use startrail.tiled_loss; drop it for this run"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"startrail.tiled_loss: the deferred logits reached {func}")


class _HoldShared(torch.autograd.Function):
    """Identity on the hidden states; holds ZeRO's reduction of ``params`` (lm_head's weights
    that another module shares: tied embeddings) from the forward until the tiled loss's
    backward has run, so their gradient is reduced once, when the embedding's part has been
    added to it (``ds_grad_is_ready``, as DeepSpeed does between shards)."""

    @staticmethod
    def forward(ctx, hidden, *params):
        ctx.params = params
        for p in params:
            p.ds_grad_is_ready = False
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        for p in ctx.params:
            p.ds_grad_is_ready = True
        return (grad, *(None for _ in ctx.params))


@dataclass
class TiledLossStats:
    """What the tiled loss did on this rank (a test's proof): tile, loss calls, shards, the
    most rows (tokens of one sequence) a shard had."""

    tokens: int
    calls: int = 0
    shards: int = 0
    max_shard_rows: int = 0
    _undo: list = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Give ``lm_head`` its forward and the model its loss function back."""
        for undo in self._undo:
            undo()
        self._undo = []


def _shard_loss(lm_head: nn.Module, ignore_index: int, normalizer):
    def fn(hidden: Tensor, labels: Tensor) -> Tensor:
        logits = lm_head(hidden).float()
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1).to(logits.device),
            ignore_index=ignore_index,
            reduction="sum",
        )
        return loss / normalizer

    return fn


def check_hf_loss(model: nn.Module, tokens) -> None:
    """``ValueError`` naming ``startrail.tiled_loss`` for a bad tile, a model without
    ``lm_head`` and ``loss_function``, or one that transforms its logits before the loss."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"startrail.tiled_loss={tokens!r}: give a whole number of tokens >= 1")
    name = type(model).__name__
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or not hasattr(
        model, "loss_function"
    ):
        raise ValueError(
            f"startrail.tiled_loss: {name} has no lm_head and loss_function (a transformers "
            "causal LM's); drop startrail.tiled_loss for this model"
        )
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(text, key, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"startrail.tiled_loss: {name} transforms its logits before the loss "
                f"({key}={value}), which the tiled loss does not do yet; drop "
                "startrail.tiled_loss for this model"
            )


def tile_hf_loss(model: nn.Module, tokens: int, active: list) -> TiledLossStats:
    """Compute ``model``'s causal-LM loss with ``lm_head`` a sequence shard of at most
    ``tokens`` local tokens at a time (module docstring). ``active``: a list the adapter's
    pre-hook fills with one item when the forward now running has labels; the next
    ``lm_head`` call then defers its logits and empties it. Refusals: ``check_hf_loss``."""
    check_hf_loss(model, tokens)
    name = type(model).__name__
    lm_head = model.lm_head
    stats = TiledLossStats(tokens=tokens)
    original_loss = model.loss_function
    had_own_loss = "_loss_function" in model.__dict__
    params = [p for p in lm_head.parameters() if p.requires_grad]
    elsewhere = {
        id(p)
        for n, p in model.named_parameters(remove_duplicate=False)
        if not n.startswith("lm_head.")
    }
    shared = [p for p in params if id(p) in elsewhere]  # tied embeddings
    own = [p for p in params if id(p) not in elsewhere]

    def forward(self, hidden):
        if not active:  # no labels in this forward: the logits themselves
            return type(self).forward(self, hidden)
        active.clear()  # one deferral per forward; the shards' own calls run lm_head
        return DeferredLogits(hidden, self, out_size(self), name)

    def loss_function(
        logits,
        labels,
        vocab_size,
        num_items_in_batch=None,
        ignore_index=-100,
        shift_labels=None,
        **kwargs,
    ):
        if not isinstance(logits, DeferredLogits):
            return original_loss(
                logits=logits,
                labels=labels,
                vocab_size=vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

        hidden = logits.hidden
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        if num_items_in_batch is None:
            num_items_in_batch = (shift_labels != ignore_index).sum()
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(hidden.device)
        hidden3 = hidden if hidden.dim() == 3 else hidden.unsqueeze(0)
        labels2 = shift_labels.reshape(hidden3.shape[:2])
        seq = hidden3.shape[1]
        shards = max(1, math.ceil(seq / tokens))
        stats.calls += 1
        stats.shards += shards
        stats.max_shard_rows = max(stats.max_shard_rows, math.ceil(seq / shards))
        if shared and hidden3.requires_grad:
            hidden3 = _HoldShared.apply(hidden3, *shared)
        return sequence_tiled_compute(
            _shard_loss(logits.lm_head, ignore_index, num_items_in_batch),
            seq,
            shards,
            {"hidden": hidden3, "labels": labels2},
            {},
            "hidden",
            compute_params=own,
            output_unshard_dimension=0,
            output_reduction="sum",
        )

    def out_size(head) -> int:  # under ZeRO-3 the weight is gathered inside lm_head's call
        return getattr(head, "out_features", None) or head.weight.shape[0]

    lm_head.forward = types.MethodType(forward, lm_head)
    model.loss_function = loss_function

    def undo_head():
        lm_head.__dict__.pop("forward", None)

    def undo_loss():
        if had_own_loss:
            model.loss_function = original_loss
        else:
            model.__dict__.pop("_loss_function", None)

    stats._undo = [undo_head, undo_loss]
    return stats
