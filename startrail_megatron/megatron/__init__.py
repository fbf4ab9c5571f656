"""Megatron-core adapter: ``--context-parallel-impl startrail``.

Entry points:
  install(team_size, placement)            hooks: groups after initialize_model_parallel,
                                           spec rewrite in GPTModel (reversible: uninstall())
  create_startrail_groups(cp_group, C)     the explicit call for own process-group collections
  StarTrailCoreAttention                   the core_attention module
  apply_startrail_spec(spec)               rewrite any GPT layer / block spec
  add_startrail_args / validate_startrail_args   the CLI flags
  enable_cpu_support()                     megatron-core on CPU ranks (compat)
"""

from .arguments import add_startrail_args, install_from_args, validate_startrail_args
from .attention import StarTrailCoreAttention
from .compat import enable_cpu_support
from .spec import apply_startrail_spec
from .state import create_startrail_groups, get_startrail_state, install, uninstall

__all__ = [
    "StarTrailCoreAttention",
    "add_startrail_args",
    "apply_startrail_spec",
    "create_startrail_groups",
    "enable_cpu_support",
    "get_startrail_state",
    "install",
    "install_from_args",
    "uninstall",
    "validate_startrail_args",
]
