"""Megatron-core adapter: ``--context-parallel-impl startrail``.

Entry points:
  install(team_size, placement)            hooks: groups after initialize_model_parallel,
                                           spec rewrite in GPTModel (reversible: uninstall())
  create_startrail_groups(cp_group, C)     the explicit call for own process-group collections
                                           (release_startrail_groups(cp_group) ends it)
  StarTrailCoreAttention                   the core_attention module (also packed documents:
                                           packed_seq_params(pack_lengths(...)) gives its THD
                                           PackedSeqParams)
  apply_startrail_spec(spec)               rewrite any GPT layer / block spec
  add_startrail_args / validate_startrail_args   the CLI flags
  cpu_support_enabled()                    megatron-core on CPU ranks, inside a with-block
                                           (or enable_cpu_support / disable_cpu_support)

Modules (imports run down this list): pretrain_gpt, launch (entry points);
training/ (the GPT application); arguments (flags); hooks (install); spec;
attention; registry (groups per CP group); refusals, versions, cpu_support.

The names are imported on first use (PEP 562): importing this package, or an
entry point inside it, does not import megatron-core, so the Megatron-LM
launcher can choose the ``megatron`` tree before anything imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "StarTrailCoreAttention": "attention",
    "add_startrail_args": "arguments",
    "apply_startrail_spec": "spec",
    "cpu_support_enabled": "cpu_support",
    "create_startrail_groups": "registry",
    "disable_cpu_support": "cpu_support",
    "enable_cpu_support": "cpu_support",
    "get_startrail_state": "registry",
    "install": "hooks",
    "install_from_args": "arguments",
    "packed_seq_params": "attention",
    "release_startrail_groups": "registry",
    "uninstall": "hooks",
    "validate_startrail_args": "arguments",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
