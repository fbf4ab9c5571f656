"""Run an unmodified DeepSpeed training script with StarTrail.

    python -m startrail_megatron.deepspeed.launch train.py --deepspeed_config ds.json ...

Works under ``torchrun`` and the ``deepspeed`` launcher as the module to run
(``torchrun --nproc-per-node 4 -m startrail_megatron.deepspeed.launch train.py ...`` or
``deepspeed --num_gpus 4 --module startrail_megatron.deepspeed.launch train.py ...``).
The ``deepspeed`` launcher puts ``--local_rank=N`` before ``train.py``; it is moved after
it (where the script's argparse expects it) and ``LOCAL_RANK`` is set if unset.
The script runs as ``__main__`` with ``sys.argv = [train.py, ...]``; its
``deepspeed.initialize`` calls go through ``startrail_megatron.deepspeed.initialize``
(``patch.patch``), so a config with an enabled ``"startrail"`` section gets
StarTrail and any other config plain DeepSpeed. The patch is undone when the
script returns.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from . import patch

__all__ = ["main", "split_argv"]

USAGE = "usage: python -m startrail_megatron.deepspeed.launch SCRIPT.py [script args ...]"


_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def split_argv(argv: list[str]) -> tuple[list[str], int | None]:
    """``(script argv, local rank)`` from the launcher's arguments.

    Leading ``--local_rank=N`` / ``--local_rank N`` (or ``--local-rank``), which the
    ``deepspeed`` launcher inserts before the script in ``--module`` mode, are moved
    after the script, spelled as given; the local rank is returned (``None`` if absent).
    """
    argv, moved, local_rank = list(argv), [], None
    while argv and argv[0].split("=", 1)[0] in _LOCAL_RANK_FLAGS:
        flag = argv.pop(0)
        if "=" in flag:
            taken, value = [flag], flag.split("=", 1)[1]
        elif argv:
            value = argv.pop(0)
            taken = [flag, value]
        else:
            raise ValueError(f"{flag} needs a value; {USAGE}")
        try:
            local_rank = int(value)
        except ValueError:
            raise ValueError(f"{' '.join(taken)}: the local rank must be an integer") from None
        moved += taken
    if not argv or not argv[0].endswith(".py"):
        raise ValueError(f"the first argument must be the training script (a .py file); {USAGE}")
    return [argv[0], *moved, *argv[1:]], local_rank


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    argv, local_rank = split_argv(argv)
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    script = argv[0]
    saved_argv = sys.argv
    sys.argv = argv
    megatron_hooks = _maybe_install_megatron_hooks(argv[1:])
    try:
        with patch.patched():
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
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config  # hjson, as DeepSpeed

    from .config import StarTrailConfig

    st = StarTrailConfig.from_ds_config(load_ds_config(path))
    if st is None or not st.active:
        return False
    from startrail_megatron.megatron import install

    install(
        st.team_size,
        st.placement,
        own_rows_first=st.own_rows_first_value,
        ulysses_size=st.ulysses_size,
    )
    return True


if __name__ == "__main__":
    main()
