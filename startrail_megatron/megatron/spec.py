"""Rewrite any GPT layer spec so that self-attention uses StarTrail.

``apply_startrail_spec`` accepts a layer ``ModuleSpec`` (local, Transformer
Engine, a user's ``--spec``), a ``TransformerBlockSubmodules`` (a decoder
block spec) or a list of layer specs, and returns a copy in which every
``SelfAttention``'s ``core_attention`` is ``StarTrailCoreAttention``; the
linear layers, norms and MLP are untouched. Building the rewritten TE spec
does not import Transformer Engine.

``gpt_layer_local_spec`` is a module-level spec object for Megatron-LM's
``--spec startrail_megatron.megatron.spec gpt_layer_local_spec``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import StarTrailCoreAttention

__all__ = ["apply_startrail_spec", "gpt_layer_local_spec"]


def _module_name(module: Any) -> str:
    if isinstance(module, tuple):  # (location, name)
        return str(module[-1])
    return getattr(module, "__name__", type(module).__name__)


def _rewrite(obj: Any, parent: str | None) -> Any:
    if isinstance(obj, ModuleSpec):
        name = _module_name(obj.module)
        if name.startswith("MLA"):
            raise NotImplementedError("StarTrail does not support multi-latent attention (MLA) yet")
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


def _local_spec() -> ModuleSpec:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return apply_startrail_spec(get_gpt_layer_local_spec())


gpt_layer_local_spec: ModuleSpec = _local_spec()
