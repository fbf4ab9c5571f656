"""What differs between the megatron-core versions we support (0.13 - 0.19).

The one place for such shims, and for what is installed beside megatron-core
(``have_transformer_engine``); the adapter calls these, never a version test:

* the process-group argument of attention modules (``model_comm_pgs`` in
  0.13/0.14, ``pg_collection`` from 0.15): ``cp_group_from``;
* ``get_batch_on_this_cp_rank``: ``(batch, cp_group=None)`` up to 0.17, where
  ``None`` means Megatron's CP group; from 0.18 ``(batch, is_hybrid_cp,
  cp_group=None, ...)``, where ``None`` means the WORLD group (0.19).
  ``batch_on_this_cp_rank`` always passes the CP group;
* the multi-token-prediction layer's attribute (``transformer_layer`` up to
  0.17, ``mtp_model_layer`` from 0.18): ``mtp_layer``;
* how ``SelfAttention`` builds ``core_attention`` (``build_module`` before
  0.16, a direct call after): our module is a plain class, which both accept;
* ``vocab_parallel_cross_entropy`` takes the TP group (``tp_group=``) from 0.17 on; before,
  it reads Megatron's global TP group: ``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = [
    "batch_on_this_cp_rank",
    "cp_group_from",
    "have_transformer_engine",
    "megatron_version",
    "mtp_layer",
    "vocab_parallel_cross_entropy",
]


def megatron_version() -> tuple[int, int]:
    from megatron.core import package_info

    major, minor = package_info.__version__.split(".")[:2]
    return int(major), int(minor)


def cp_group_from(pg_collection: Any = None, model_comm_pgs: Any = None):
    """The context-parallel group an attention module was given, whatever the version."""
    for pgs in (pg_collection, model_comm_pgs):
        if pgs is not None and getattr(pgs, "cp", None) is not None:
            return pgs.cp
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def batch_on_this_cp_rank(batch: dict, cp_group) -> dict:
    """``megatron.core.utils.get_batch_on_this_cp_rank`` of ``batch`` over ``cp_group``
    (Megatron's per-sequence zigzag), given the group explicitly on every version."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if cp_group is None:
        raise ValueError("batch_on_this_cp_rank needs the context-parallel group, got None")
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def mtp_layer(mtp_block_layer: Any):
    """The transformer layer inside one ``MultiTokenPredictionLayer``, whatever its name."""
    for name in ("mtp_model_layer", "transformer_layer"):
        layer = getattr(mtp_block_layer, name, None)
        if layer is not None:
            return layer
    raise AttributeError(
        f"{type(mtp_block_layer).__name__} has neither mtp_model_layer (megatron-core >= 0.18) "
        "nor transformer_layer (<= 0.17)"
    )


def have_transformer_engine() -> bool:
    """Whether Transformer Engine is installed and usable here (it needs CUDA)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def vocab_parallel_cross_entropy(logits, labels, tp_group=None):
    """megatron-core's per-token cross-entropy of vocabulary-parallel ``logits`` [s, b, V/TP]
    against ``labels`` [s, b], over ``tp_group`` where the release takes one (else over
    Megatron's TP group, the same one in every model this adapter builds)."""
    from megatron.core import tensor_parallel

    fn = tensor_parallel.vocab_parallel_cross_entropy
    if tp_group is not None and "tp_group" in inspect.signature(fn).parameters:
        return fn(logits, labels, tp_group=tp_group)
    return fn(logits, labels)
