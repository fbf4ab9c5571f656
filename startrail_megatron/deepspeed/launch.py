"""Run an unmodified DeepSpeed training script with StarTrail.

    python -m startrail_megatron.deepspeed.launch train.py --deepspeed_config ds.json ...

Works under ``torchrun`` / the ``deepspeed`` launcher as the module to run
(``torchrun --nproc-per-node 4 -m startrail_megatron.deepspeed.launch train.py ...``).
The script runs as ``__main__`` with ``sys.argv = [train.py, ...]``; its
``deepspeed.initialize`` calls go through ``startrail_megatron.deepspeed.initialize``
(``compat.patch``), so a config with an enabled ``"startrail"`` section gets
StarTrail and any other config plain DeepSpeed. The patch is undone when the
script returns.
"""

from __future__ import annotations

import importlib.util
import json
import runpy
import sys

from . import compat

__all__ = ["main"]

USAGE = "usage: python -m startrail_megatron.deepspeed.launch SCRIPT.py [script args ...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    script = argv[0]
    if not script.endswith(".py"):
        raise ValueError(f"the first argument must be the training script (a .py file); {USAGE}")
    saved_argv = sys.argv
    sys.argv = argv
    megatron_hooks = _maybe_install_megatron_hooks(argv[1:])
    try:
        with compat.patched():
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
        if megatron_hooks:
            from startrail_megatron.megatron import uninstall

            uninstall()


def _config_path(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        for flag in ("--deepspeed_config", "--deepspeed-config"):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def _maybe_install_megatron_hooks(args: list[str]) -> bool:
    """Install the Megatron hooks for an enabled section when megatron-core is present."""
    path = _config_path(args)
    if path is None or importlib.util.find_spec("megatron.core") is None:
        return False
    from .config import StarTrailConfig

    with open(path) as f:
        st = StarTrailConfig.from_ds_config(json.load(f))
    if st is None or not st.active:
        return False
    from startrail_megatron.megatron import install

    install(st.team_size, st.placement)
    return True


if __name__ == "__main__":
    main()
