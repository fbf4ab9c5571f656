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
    try:
        with compat.patched():
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv


if __name__ == "__main__":
    main()
