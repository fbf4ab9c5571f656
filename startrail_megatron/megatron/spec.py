"""Rewrite any GPT layer spec so that self-attention uses StarTrail; refuse a built
model that would mix tokens any other way on a CP rank.

``apply_startrail_spec`` accepts a layer ``ModuleSpec`` (local, Transformer
Engine, a user's ``--spec``), a ``TransformerBlockSubmodules`` (a decoder
block spec), a hybrid stack spec (``HybridStackSubmodules``, megatron-core
0.19) or a list of layer specs, and returns a copy in which every
``SelfAttention``'s ``core_attention`` is ``StarTrailCoreAttention``; the
linear layers, norms and MLP are untouched. Building the rewritten TE spec
does not import Transformer Engine. Multi-latent attention (MLA) specs are left
as they are: a hybrid stack spec carries one whether or not its pattern uses it.

``check_startrail_model`` is the guard behind the rewrite: on a CP group of more
than one rank, every built ``Attention`` module must hold StarTrail, and no
other token mixer (Mamba, gated delta net, DeepSeek sparse attention) may be
present, or the model is refused by name (``ValueError``) before it trains: it
would otherwise attend over each rank's local tokens only, silently wrong.

``gpt_layer_local_spec`` is a module-level spec object for Megatron-LM's
``--spec startrail_megatron.megatron.spec gpt_layer_local_spec``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import StarTrailCoreAttention

__all__ = ["apply_startrail_spec", "check_startrail_model", "gpt_layer_local_spec"]

# Token mixers other than attention, by class name (they move across megatron-core
# versions): StarTrail does not split them, and on CP ranks they would see local tokens.
OTHER_TOKEN_MIXERS = ("MambaMixer", "GatedDeltaNet", "DSAttention")


def _module_name(module: Any) -> str:
    if isinstance(module, tuple):  # (location, name)
        return str(module[-1])
    return getattr(module, "__name__", type(module).__name__)


def _rewrite(obj: Any, parent: str | None) -> Any:
    if isinstance(obj, ModuleSpec):
        name = _module_name(obj.module)
        if "MLA" in name:  # refused when built (check_startrail_model), not rewritten
            return obj
        sub = _rewrite(obj.submodules, name) if obj.submodules is not None else None
        return dataclasses.replace(obj, submodules=sub)
    if isinstance(obj, list):
        return [_rewrite(x, parent) for x in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            val = getattr(obj, f.name)
            if (
                f.name == "core_attention"
                and parent is not None
                and parent.endswith("SelfAttention")
            ):
                changes[f.name] = StarTrailCoreAttention
            elif isinstance(val, (ModuleSpec, list)) or (
                dataclasses.is_dataclass(val) and not isinstance(val, type)
            ):
                changes[f.name] = _rewrite(val, parent)
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


def apply_startrail_spec(spec: Any) -> Any:
    """A copy of ``spec`` with StarTrail attention in every self-attention."""
    return _rewrite(spec, None)


def check_startrail_model(model: Any, cp_size: int) -> None:
    """Refuse a model whose token mixing is not all StarTrail on ``cp_size`` > 1 ranks."""
    if cp_size <= 1:
        return
    from megatron.core.transformer.attention import Attention

    for path, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, Attention):
            inner = getattr(module, "core_attention", None)
            if isinstance(inner, StarTrailCoreAttention):
                continue
            what = f"{kind} with core attention {type(inner).__name__}"
        elif kind in OTHER_TOKEN_MIXERS:
            what = kind
        else:
            continue
        raise ValueError(
            f"--context-parallel-impl startrail at context-parallel size {cp_size}: layer "
            f"{path!r} is a {what}, which StarTrail does not split; it would mix only this "
            "rank's local tokens. Allowed on StarTrail's CP ranks: self-attention layers "
            "(GPTModel's, HybridModel's '*' layers, MTP layers) with MLPs and MoE; train "
            "this model with --context-parallel-size 1 or another CP implementation"
        )


def _local_spec() -> ModuleSpec:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return apply_startrail_spec(get_gpt_layer_local_spec())


gpt_layer_local_spec: ModuleSpec = _local_spec()
