"""Hugging Face ``transformers`` causal LMs on StarTrail, without model-code changes.

``prepare_hf_model(model, mpu)`` does three things, all undone by the handle:

1. Attention: registers ``"startrail"`` in transformers' ``AttentionInterface``
   and switches the model to it (``set_attn_implementation``), the way
   DeepSpeed's Ulysses-for-HF plugs in. transformers calls it with query
   ``[b, hq, s, d]``, key/value ``[b, hkv, s, d]`` (after RoPE) and expects
   ``([b, s, hq, d], weights)``; we transpose to and from our
   ``[s, b, h, d]``. transformers builds no mask for an implementation it does
   not know, so none is materialised: causality comes from StarTrail.
   ``sliding_window`` (causal models: Mistral, Qwen2, Gemma 2/3, GPT-OSS; a window of
   the last W keys), ``softcap`` (Gemma 2) and attention sinks (``s_aux``/``sinks``,
   GPT-OSS) go to StarTrail's ``window``/``softcap``/``sinks``; ``position_bias`` is
   refused (``NotImplementedError``); ``scaling`` is the softmax scale; ``dropout`` (the
   config's ``attention_dropout`` in training, 0 in evaluation, as transformers
   passes it) is StarTrail's attention dropout, drawn from the default generator as
   transformers' eager attention draws its own.
2. Inputs (``shard_inputs=True``): a forward pre-hook takes the full-sequence
   batch the script passes (the same on every rank of a sequence group) and
   keeps this rank's zigzag shard (``batches.py``: ``shard_causal_lm_batch``): input_ids,
   position_ids (global, so RoPE is right) and labels shifted *before*
   sharding. A row of packed documents whose position_ids restart at 0 per
   document (``DataCollatorWithFlattening``, batch of one row; or its
   ``cu_seq_lens_q/k`` flash-attention kwargs) is sharded per document instead (``packing.py``: each document padded to a multiple of 2P,
   labels -100 on padding and at each document's last token) and its attention
   stays inside each document (``cu_seqlens``). With
   ``startrail.hybrid_context_parallel`` a row's documents are placed on sub-groups of
   the P ranks instead (``hybrid.py``) and every layer runs ``batch_attention``. Scripts
   that shard in their data loader (``StarTrailDataLoaderAdapter``, which does the same
   for packed rows) use ``shard_inputs=False``. Each forward's documents stay known to its
   backward (activation checkpointing runs the attention again there; ``documents.py``).
3. Loss: transformers' causal-LM loss is given ``shift_labels`` and
   ``num_items_in_batch`` = (valid tokens of the global batch) / D, so each
   rank's loss is (its token-loss sum) / that count: the sequence ranks'
   gradients sum to the replica's true gradient and DeepSpeed's average over
   the D replicas gives the global batch's gradient. A forward hook makes the
   returned loss *value* the whole replica's loss (sum over the sequence
   group) while its gradient stays this rank's part, and applies
   ``grad_scale`` (set by ``initialize`` for ZeRO-3, see ``entry.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..attention import startrail_attention
from ..batch_attention import batch_attention
from ..comm import CommLedger
from ..schedule.batch import BatchLayout
from ..schedule.packing import PackedLayout
from .batches import (
    PACKED_KEY,
    check_consecutive,
    check_no_padding,
    check_same_batch,
    loss_normalizer,
    position_ids_from_flash_kwargs,
    shard_row,
)
from .documents import ForwardDocuments
from .hybrid import idle_attention
from .mpu import StarTrailMPU

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFHandle",
    "prepare_hf_model",
    "startrail_hf_attention",
]

ATTN_IMPLEMENTATION = "startrail"
_SPEC_ATTR = "_startrail_groups"


def startrail_hf_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers ``AttentionInterface`` function: query ``[b, hq, s, d]`` -> ``[b, s, hq, d]``."""
    handle: HFHandle | None = getattr(module, _SPEC_ATTR, None)
    if handle is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTN_IMPLEMENTATION!r} but was not "
            "prepared by startrail_megatron.deepspeed.prepare_hf_model"
        )
    if attention_mask is not None:
        raise ValueError(
            "StarTrail attention takes no attention_mask (only causal or full attention over "
            "unpadded sequences); pass attention_mask=None or all ones"
        )
    groups = handle.mpu.startrail
    _check_unsupported(query.shape[2] * groups.cp_size, kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    extra = _window_and_sinks(bool(causal), kwargs)
    handle.local_lengths.add(query.shape[2])
    packed = handle.documents.of(kwargs.get("position_ids"))
    if isinstance(packed, BatchLayout):  # startrail.hybrid_context_parallel
        return _batch_attention(handle, packed, query, key, value, causal, scaling, dropout, extra)
    out = startrail_attention(
        query.permute(2, 0, 1, 3),  # [s, b, hq, d]
        key.permute(2, 0, 1, 3),  # [s, b, hkv, d]
        value.permute(2, 0, 1, 3),
        groups,
        causal=bool(causal),
        softmax_scale=scaling,
        ledger=handle.ledger,
        cu_seqlens=packed.cu_seqlens if packed is not None else None,
        cu_seqlens_padded=packed.cu_seqlens_padded if packed is not None else None,
        dropout_p=float(dropout or 0.0),
        tile=handle.mpu.config.attention_tile,
        head_chunks=handle.mpu.config.attention_head_chunks,
        **extra,
    )  # [s, b, hq, d]
    if dropout:
        handle.dropout_calls += 1
    return out.transpose(0, 1), None  # [b, s, hq, d]


def _batch_attention(handle, layout, query, key, value, causal, scaling, dropout, extra):
    """``startrail_hf_attention`` under the batch's per-batch layout (``hybrid.py``)."""
    mpu = handle.mpu
    q, k, v = (x.permute(2, 0, 1, 3) for x in (query, key, value))  # [s, b, h, d]
    if layout.idle(layout.block_of(mpu.batch_groups.cp_rank)):
        # an idle rank: its one padding token (hybrid.py); with 0 rows batch_attention
        # sends nothing but joins the ranks' check of the layout
        batch_attention(q[:0], k[:0], v[:0], layout, mpu.batch_groups, causal=bool(causal))
        return idle_attention(query, key, value), None
    out = batch_attention(
        q, k, v, layout, mpu.batch_groups, causal=bool(causal), softmax_scale=scaling,
        ledger=handle.ledger, dropout_p=float(dropout or 0.0), tile=mpu.config.attention_tile,
        head_chunks=mpu.config.attention_head_chunks, **extra,
    )  # fmt: skip
    if dropout:
        handle.dropout_calls += 1
    return out.transpose(0, 1), None


# Arguments transformers' attention functions take beyond plain (causal) softmax attention;
# models pass them unset as None (e.g. Mistral's sliding_window when the config has none).
_UNSUPPORTED = {
    "position_bias": "an additive position bias",
    # flash-attn varlen metadata of packed batches (DataCollatorWithFlattening)
    "cu_seq_lens_q": "packed sequences (varlen cu_seqlens)",
    "cu_seq_lens_k": "packed sequences (varlen cu_seqlens)",
}


def _window_and_sinks(causal: bool, kwargs: dict) -> dict:
    """transformers' ``sliding_window`` (W: the last W keys including the query's own, as
    ``masking_utils.sliding_window_causal_mask_function`` builds it: ``(W - 1, 0)``),
    ``softcap`` (Gemma 2) and ``s_aux`` / ``sinks`` (GPT-OSS) as ``startrail_attention``
    arguments."""
    out: dict = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window={window!r} must be an integer >= 1 or None")
        if not causal:  # transformers' bidirectional windows differ by path (W or W - 1)
            raise NotImplementedError(
                f"sliding_window={window} on a non-causal model is not supported by StarTrail"
            )
        out["window"] = (window - 1, 0)
    if kwargs.get("softcap") is not None:
        out["softcap"] = float(kwargs["softcap"])
    sinks = [kwargs.get(n) for n in ("s_aux", "sinks") if kwargs.get(n) is not None]
    if len(sinks) > 1:
        raise ValueError("give attention sinks once (s_aux or sinks)")
    if sinks:
        out["sinks"] = sinks[0]
    return out


def _check_unsupported(seq_len: int, kwargs: dict) -> None:
    """Refuse what StarTrail would otherwise silently compute as plain attention."""
    for name, what in _UNSUPPORTED.items():
        value = kwargs.get(name)
        if value is not None:
            shown = f"a {tuple(value.shape)} tensor" if isinstance(value, Tensor) else repr(value)
            raise NotImplementedError(
                f"{name}={shown} ({what}) is not supported by StarTrail's attention; this model "
                f"passes it, so it cannot use attn_implementation={ATTN_IMPLEMENTATION!r}"
            )


def _scaled(v, factor: float):
    """``v`` with ``ScaleGrad`` on every tensor that needs a gradient, inside tuples and
    lists too (a loss term taken from ``hidden_states`` is scaled as the loss is)."""
    if isinstance(v, Tensor):
        return ScaleGrad.apply(v, factor) if v.requires_grad else v
    if isinstance(v, (tuple, list)):
        return type(v)(_scaled(x, factor) for x in v)
    return v


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.factor, None


class _ReplicaLoss(torch.autograd.Function):
    """Value: the sum of the sequence group's partial losses; gradient: this rank's part."""

    @staticmethod
    def forward(ctx, loss: Tensor, group: dist.ProcessGroup) -> Tensor:
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


@dataclass
class HFHandle:
    """What ``prepare_hf_model`` changed; ``remove()`` undoes it."""

    model: nn.Module
    mpu: StarTrailMPU
    shard_inputs: bool
    previous_attn_implementation: str | None
    grad_scale: float = 1.0
    """Factor on every output's gradient (``initialize`` sets P for ZeRO-3)."""
    ledger: CommLedger = field(default_factory=CommLedger)
    """Every transfer StarTrail's attention made on this rank (bytes and calls, fwd/bwd)."""
    local_lengths: set = field(default_factory=set)
    """The sequence lengths the attention saw on this rank (S/P when sharding works)."""
    documents: ForwardDocuments = field(default_factory=ForwardDocuments)
    """The layout of each forward's documents (``documents.py``): a packed row's
    ``PackedLayout``, the per-batch ``BatchLayout`` (``startrail.hybrid_context_parallel``;
    ``hybrid.py``), or None."""
    dropout_calls: int = 0
    """Attention calls that ran attention dropout on this rank."""
    tiled_mlp: object = None
    """``tiled_mlp.TiledMLPStats`` when the MLPs are tiled (``prepare_hf_model(tiled_mlp=)``)."""
    tiled_loss: object = None
    """``tiled_loss.TiledLossStats`` when the loss is tiled (``prepare_hf_model(tiled_loss=)``)."""
    _defer_logits: list = field(default_factory=list)
    _hooks: list = field(default_factory=list)
    _modules: list = field(default_factory=list)

    def remove(self) -> None:
        for stats in (self.tiled_mlp, self.tiled_loss):
            if stats is not None:
                stats.remove()
        self.tiled_mlp = self.tiled_loss = None
        for h in self._hooks:
            h.remove()
        for m in self._modules:
            if hasattr(m, _SPEC_ATTR):
                delattr(m, _SPEC_ATTR)
        if self.previous_attn_implementation is not None:
            self.model.set_attn_implementation(self.previous_attn_implementation)
        self._hooks, self._modules = [], []
        if getattr(self.model, "_startrail_handle", None) is self:
            del self.model._startrail_handle

    # ---- hooks ---------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        if args:
            raise ValueError(
                "pass the batch to a StarTrail model as keywords (input_ids=..., labels=...)"
            )
        if kwargs.get("inputs_embeds") is not None:
            raise NotImplementedError("StarTrail's HF adapter needs input_ids, not inputs_embeds")
        check_no_padding(kwargs.pop("attention_mask", None))
        cfg = self.model.config
        router = kwargs.get("output_router_logits")
        router = getattr(cfg, "output_router_logits", False) if router is None else router
        if (
            router
            and (kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None)
            and getattr(cfg, "router_aux_loss_coef", 0)
        ):
            raise NotImplementedError(
                "output_router_logits with router_aux_loss_coef > 0 on StarTrail: the model "
                "adds the router's load-balancing loss of this rank's tokens to a loss that is "
                "summed over the P sequence ranks, so it would count P times; pass "
                "output_router_logits=False (or set router_aux_loss_coef=0)"
            )
        mpu = self.mpu
        hybrid = mpu.batch_schedule is not None
        # StarTrailDataLoaderAdapter's packed layout (with hybrid: the batch's BatchLayout)
        given = kwargs.pop(PACKED_KEY, None)
        want = BatchLayout if hybrid else PackedLayout
        if given is not None and not isinstance(given, want):
            raise ValueError(
                f"{PACKED_KEY} must be a {want.__name__} here, got {type(given).__name__}"
            )
        if given is not None and self.shard_inputs:
            raise ValueError(
                f"{PACKED_KEY} comes with already sharded batches (shard_inputs=False); this "
                "model shards its inputs itself"
            )
        if hybrid and not self.shard_inputs and given is None:
            raise ValueError(
                f"startrail.hybrid_context_parallel with shard_inputs=False: feed batches from "
                f"StarTrailDataLoaderAdapter, which gives each its layout ({PACKED_KEY})"
            )
        layout = given
        if self.shard_inputs:
            ids = kwargs["input_ids"]
            check_same_batch(ids, mpu.sequence_parallel_group)
            position_ids = position_ids_from_flash_kwargs(kwargs, ids.shape)
            shard, layout = shard_row(ids, kwargs.get("labels"), position_ids, mpu)
            kwargs.update(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
            if "shift_labels" in shard:
                kwargs["shift_labels"] = shard["shift_labels"]
        self._defer_logits.clear()
        if kwargs.get("shift_labels") is not None and self.tiled_loss is not None:
            self._defer_logits.append(True)
        if kwargs.get("shift_labels") is not None:
            kwargs["labels"] = kwargs["shift_labels"]  # non-None so transformers computes the loss
            if kwargs.get("num_items_in_batch") is None:
                kwargs["num_items_in_batch"] = loss_normalizer(kwargs["shift_labels"], mpu)
        elif kwargs.get("labels") is not None:
            raise ValueError(
                "with shard_inputs=False pass shift_labels (StarTrailDataLoaderAdapter gives "
                "them), not labels: labels must be shifted over the global sequence"
            )
        if not self.shard_inputs and kwargs.get("position_ids") is None:
            raise ValueError(
                "with shard_inputs=False pass position_ids (StarTrailDataLoaderAdapter gives "
                "them): a shard's tokens sit at global positions, not 0, 1, 2, ..."
            )
        if not self.shard_inputs and given is None:
            # A zigzag shard holds two runs (chunks r and 2P-1-r): each must step by one.
            for half in kwargs["position_ids"].chunk(2, dim=-1):
                check_consecutive(half, "position_ids (this rank's zigzag shard)")
        self.documents.start(layout, kwargs.get("position_ids"))
        return args, kwargs

    def _post_hook(self, module, args, kwargs, output):
        # return_dict=True gives a ModelOutput (a mapping); return_dict=False a tuple whose
        # first item is the loss when labels were passed.
        has_loss = kwargs.get("labels") is not None
        if isinstance(output, Mapping):
            items = {k: output[k] for k in output.keys()}
        elif isinstance(output, tuple):
            items = dict(enumerate(output))
        else:
            raise NotImplementedError(
                f"StarTrail's HF adapter expects a ModelOutput or tuple, got {type(output).__name__}"
            )
        loss_key = "loss" if isinstance(output, Mapping) else (0 if has_loss else None)
        if loss_key in items and items[loss_key] is not None:
            items[loss_key] = _ReplicaLoss.apply(items[loss_key], self.mpu.sequence_parallel_group)
        if self.grad_scale != 1.0:
            items = {k: _scaled(v, self.grad_scale) for k, v in items.items()}
        self.documents.end(items.values())  # the next forward says again what its row holds
        if isinstance(output, Mapping):
            for k, v in items.items():
                output[k] = v
            return output
        return tuple(items[i] for i in range(len(output)))


def prepare_hf_model(
    model: nn.Module,
    mpu: StarTrailMPU,
    *,
    shard_inputs: bool = True,
    tiled_mlp: int | None = None,
    tiled_loss: int | None = None,
) -> HFHandle:
    """Run a transformers causal LM on StarTrail (see the module docstring); reversible.
    ``tiled_mlp``: tokens per shard of every decoder layer's MLP (DeepSpeed's ``TiledMLP``,
    ``tiled_mlp.py``); ``tiled_loss``: tokens per shard of the output layer and the loss
    (DeepSpeed's ``sequence_tiled_compute``, ``tiled_loss.py``); ``handle.tiled_mlp`` and
    ``handle.tiled_loss`` keep what they did."""
    try:
        from transformers import AttentionInterface, PreTrainedModel
    except ImportError as e:  # pragma: no cover - the extra is pinned
        raise ImportError("prepare_hf_model needs transformers (pip install '.[deepspeed]')") from e
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"prepare_hf_model needs a transformers PreTrainedModel, got {type(model).__name__}"
        )
    if getattr(model, "_startrail_handle", None) is not None:
        raise ValueError("this model is already prepared for StarTrail (model._startrail_handle)")
    AttentionInterface.register(ATTN_IMPLEMENTATION, startrail_hf_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{type(model).__name__} cannot switch its attention implementation "
            "(it does not use transformers' AttentionInterface)"
        )
    handle = HFHandle(model, mpu, shard_inputs, previous)
    for m in model.modules():
        # transformers' attention modules: the ones that call the interface carry is_causal.
        if hasattr(m, "is_causal") and hasattr(m, "config") and not isinstance(m, PreTrainedModel):
            setattr(m, _SPEC_ATTR, handle)
            handle._modules.append(m)
    if not handle._modules:
        handle.remove()
        raise ValueError(f"found no attention modules (with is_causal) in {type(model).__name__}")
    try:
        if tiled_mlp is not None:
            from .tiled_mlp import tile_hf_mlps

            handle.tiled_mlp = tile_hf_mlps(model, tiled_mlp)
        if tiled_loss is not None:
            from .tiled_loss import tile_hf_loss

            handle.tiled_loss = tile_hf_loss(model, tiled_loss, handle._defer_logits)
    except ValueError:
        handle.remove()
        raise
    handle._hooks.append(model.register_forward_pre_hook(handle._pre_hook, with_kwargs=True))
    handle._hooks.append(model.register_forward_hook(handle._post_hook, with_kwargs=True))
    model._startrail_handle = handle
    return handle
