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
"""

from __future__ import annotations

import functools
import os
import runpy
import sys


def install_megatron_lm_hooks() -> None:
    """Chain StarTrail's extra_args_provider into megatron.training's parse_args."""
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
    if getattr(mlm_initialize, "parse_args", None) is orig:
        mlm_initialize.parse_args = parse_args


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
        for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[name]
    install_megatron_lm_hooks()
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
