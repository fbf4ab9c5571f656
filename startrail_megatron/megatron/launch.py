"""Run Megatron-LM's own training script with StarTrail, unmodified.

    python -m startrail_megatron.launch /path/to/Megatron-LM/pretrain_gpt.py <its args> \\
        --context-parallel-size 8 --context-parallel-impl startrail --startrail-team-size 2

Works under ``torchrun`` (``torchrun ... -m startrail_megatron.launch ...``).
It puts the script's folder first on ``sys.path`` (so ``megatron`` is that
Megatron-LM tree), wraps ``megatron.training``'s ``parse_args`` so that the
script's own ``extra_args_provider`` is chained with StarTrail's (flags added,
validated, hooks installed right after parsing), then runs the script as
``__main__``. The hooks build StarTrail's groups after
``initialize_model_parallel`` and rewrite the layer spec given to ``GPTModel``.

Called in a process that already imported megatron-core from elsewhere,
``main`` drops it (and StarTrail's Megatron adapter, which holds its classes)
from ``sys.modules`` so that both are imported again from the script's tree.
The ``parse_args`` wrapper is removed when the script returns.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

_UNDO: list = []


def install_megatron_lm_hooks() -> None:
    """Chain StarTrail's extra_args_provider into megatron.training's parse_args.

    Idempotent; ``uninstall_megatron_lm_hooks()`` undoes it."""
    from megatron.training import arguments as mlm_arguments
    from megatron.training import initialize as mlm_initialize

    from startrail_megatron.megatron.arguments import extra_args_provider

    orig = mlm_arguments.parse_args
    if getattr(orig, "_startrail", False):
        return

    @functools.wraps(orig)
    def parse_args(extra_args_provider_fn=None, ignore_unknown_args=False):
        provider = functools.partial(extra_args_provider, chain=extra_args_provider_fn)
        return orig(provider, ignore_unknown_args)

    parse_args._startrail = True
    mlm_arguments.parse_args = parse_args
    _UNDO.append(lambda: setattr(mlm_arguments, "parse_args", orig))
    if getattr(mlm_initialize, "parse_args", None) is orig:
        mlm_initialize.parse_args = parse_args
        _UNDO.append(lambda: setattr(mlm_initialize, "parse_args", orig))


def uninstall_megatron_lm_hooks() -> None:
    while _UNDO:
        _UNDO.pop()()


def _purge_megatron() -> None:
    """Forget megatron and StarTrail's Megatron adapter (which imported megatron classes)."""
    adapter = "startrail_megatron.megatron"
    old_hooks = sys.modules.get(adapter + ".hooks")
    if old_hooks is not None:
        old_hooks.uninstall()  # hooks set on the old megatron-core's modules
    for name in list(sys.modules):
        if name == "megatron" or name.startswith(("megatron.", adapter + ".")) or name == adapter:
            del sys.modules[name]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        sys.exit(
            "usage: python -m startrail_megatron.launch /path/to/Megatron-LM/pretrain_gpt.py "
            "<its args> --context-parallel-impl startrail --startrail-team-size C"
        )
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        sys.exit(f"startrail_megatron.launch: no such script: {script}")
    sys.path.insert(0, os.path.dirname(script))
    if "megatron" in sys.modules and "megatron.training" not in sys.modules:
        # megatron-core was imported from elsewhere first; use the script's tree instead.
        _purge_megatron()
    install_megatron_lm_hooks()
    sys.argv = [script, *argv[1:]]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        uninstall_megatron_lm_hooks()


if __name__ == "__main__":
    main()
