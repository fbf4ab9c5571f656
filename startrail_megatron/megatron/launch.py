"""Run Megatron-LM's own training script with StarTrail, unmodified.

    python -m startrail_megatron.launch /path/to/Megatron-LM/pretrain_gpt.py <its args> \\
        --context-parallel-size 8 --context-parallel-impl startrail --startrail-team-size 2

Works under ``torchrun`` (``torchrun ... -m startrail_megatron.launch ...``;
``startrail_megatron.megatron.launch`` is the same module). ``main`` changes
the process, for the script:

* ``sys.path``: the script's folder goes first (so ``megatron`` is that
  Megatron-LM tree), and stays (the script's modules may be imported later);
* ``sys.modules``, only when a ``megatron`` other than the script's tree was
  imported before ``main`` (``_foreign_megatron``): that ``megatron`` and its
  submodules, and StarTrail's Megatron adapter modules (which hold its
  classes) except this one, are removed, so that both are imported again from
  the script's tree. The old adapter's hooks are uninstalled and its CPU
  patches undone first; if StarTrail groups are registered for the old
  megatron-core, ``main`` refuses (release them first). Not undone: the
  removed modules belong to a megatron-core the process no longer uses;
* ``megatron.training``'s ``parse_args`` is wrapped so that the script's own
  ``extra_args_provider`` is chained with StarTrail's (flags added, validated,
  hooks installed right after parsing: they build StarTrail's groups after
  ``initialize_model_parallel`` and rewrite the layer spec given to
  ``GPTModel``); the wrapper is removed when the script returns;
* ``sys.argv`` is the script's while it runs, restored afterwards.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

_ADAPTER = "startrail_megatron.megatron"
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


def _foreign_megatron(tree: str) -> bool:
    """Whether the imported ``megatron`` is not the one of the Megatron-LM tree ``tree``.

    It is foreign when its package path lacks ``tree/megatron``, or when it
    imported ``megatron.core`` from elsewhere although ``tree`` has its own
    (both are namespace packages: the wheel's ``megatron`` then also reaches
    ``tree``'s ``megatron.training``, beside the wheel's megatron-core)."""
    pkg = sys.modules.get("megatron")
    if pkg is None:
        return False
    mine = os.path.realpath(os.path.join(tree, "megatron"))
    if mine not in {os.path.realpath(p) for p in getattr(pkg, "__path__", ())}:
        return True
    core = sys.modules.get("megatron.core")
    if core is None or not os.path.isdir(os.path.join(mine, "core")):
        return False
    return not os.path.realpath(getattr(core, "__file__", "") or "").startswith(mine + os.sep)


def _forget_megatron() -> None:
    """Remove the imported megatron and StarTrail's adapter modules (see the docstring)."""
    registry = sys.modules.get(_ADAPTER + ".registry")
    if registry is not None and registry.registered_cp_groups():
        raise RuntimeError(
            "startrail_megatron.launch: StarTrail groups are registered for the megatron-core "
            "imported before the launcher; release them "
            "(startrail_megatron.megatron.registry.release_all_startrail_groups()) first"
        )
    hooks = sys.modules.get(_ADAPTER + ".hooks")
    if hooks is not None:
        hooks.uninstall()  # hooks set on the old megatron-core's modules
    cpu = sys.modules.get(_ADAPTER + ".cpu_support")
    while cpu is not None and cpu.cpu_support_active():
        cpu.disable_cpu_support()
    keep = {__name__, _ADAPTER + ".launch"}
    for name in list(sys.modules):
        ours = name == _ADAPTER or name.startswith(_ADAPTER + ".")
        if name == "megatron" or name.startswith("megatron.") or (ours and name not in keep):
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
    tree = os.path.dirname(script)
    sys.path.insert(0, tree)
    if _foreign_megatron(tree):
        _forget_megatron()
    install_megatron_lm_hooks()
    saved_argv, sys.argv = sys.argv, [script, *argv[1:]]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
        uninstall_megatron_lm_hooks()


if __name__ == "__main__":
    main()
