"""The model and its optimizer: ``GPTModel`` in megatron-core's DDP, AdamW/SGD or Megatron's.

``layer_spec`` is the local spec (the Transformer Engine spec where TE is
usable), rewritten for StarTrail with ``--context-parallel-impl startrail``.
Optimizer: megatron-core's optimizer wrapper allocates on CUDA, so on CPU
ranks ``build_optimizer`` gives ``torch.optim.AdamW`` (or SGD) over the
parameters, stepped on megatron DDP's ``main_grad`` by ``step.optimizer_step``.
"""

from __future__ import annotations

import argparse
import inspect

import torch

from .. import versions
from ..spec import apply_startrail_spec
from .recompute import recompute_config

__all__ = ["build_model", "build_optimizer", "layer_spec", "transformer_config"]


def transformer_config(args: argparse.Namespace):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        window_size=getattr(args, "window_size", None),
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        softmax_type=getattr(args, "softmax_type", "vanilla"),
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        init_method_std=args.init_method_std,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        **recompute_config(args),
    )


def layer_spec(args: argparse.Namespace):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    # megatron-core 0.16's TE spec takes no normalization: TENorm reads the config
    if versions.have_transformer_engine():
        spec = _call_supported(
            get_gpt_layer_with_transformer_engine_spec, normalization=args.normalization
        )
    else:
        spec = _call_supported(get_gpt_layer_local_spec, normalization=args.normalization)
    return apply_startrail_spec(spec) if args.context_parallel_impl == "startrail" else spec


def _call_supported(fn, **kwargs):
    """``fn(**kwargs)`` with only the keywords ``fn``'s signature has (they vary by release)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def build_model(args: argparse.Namespace):
    """GPTModel wrapped in megatron-core's DDP (gradients averaged over DP x CP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    if getattr(args, "startrail_tiled_loss", None):
        from ..tiled_loss import tile_lm_loss

        tile_lm_loss(model, args.startrail_tiled_loss)
    if getattr(args, "startrail_tiled_mlp", None):
        from ..tiled_mlp import tile_mlps

        tile_mlps(model, args.startrail_tiled_mlp)
    if torch.cuda.is_available():
        model.cuda()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(args: argparse.Namespace, model):
    if torch.cuda.is_available():
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum,
            bf16=args.bf16,
            clip_grad=args.clip_grad,
        )
        return get_megatron_optimizer(cfg, [model])
    groups = param_groups(model, args.weight_decay)
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)
    return torch.optim.AdamW(
        groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps
    )


def param_groups(model, weight_decay: float) -> list[dict]:
    """megatron-core's two groups: weight decay on the matrices, none on biases and 1-D
    parameters (norms); ``wd_mult`` is what the LR/WD scheduler multiplies by."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]
