"""What differs between the megatron-core versions we support (0.13 - 0.16).

The process-group argument of attention modules (``model_comm_pgs`` in
0.13/0.14, ``pg_collection`` from 0.15), and how ``SelfAttention`` builds
``core_attention`` (``build_module`` before 0.16, a direct call after: our
module is a plain class, which both accept). The one place for such shims.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cp_group_from", "megatron_version"]


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
