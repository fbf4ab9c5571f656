"""What differs between the megatron-core versions we support (0.13 - 0.16).

The process-group argument of attention modules (``model_comm_pgs`` in
0.13/0.14, ``pg_collection`` from 0.15), and how ``SelfAttention`` builds
``core_attention`` (``build_module`` before 0.16, a direct call after: our
module is a plain class, which both accept). The one place for such shims,
and for what is installed beside megatron-core (``have_transformer_engine``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cp_group_from", "have_transformer_engine", "megatron_version"]


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


def have_transformer_engine() -> bool:
    """Whether Transformer Engine is installed and usable here (it needs CUDA)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()
