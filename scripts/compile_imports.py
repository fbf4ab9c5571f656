"""Byte-compiles what the project imports, by importing it once (run by setup_env.sh).

uv's ``--compile-bytecode`` compiles every file of every installed package (torch alone has
thousands nobody imports here): 50 - 60 CPU seconds per fresh environment. Importing the
project's modules with ``PYTHONDONTWRITEBYTECODE`` unset writes the bytecode of exactly
the modules they load, in ~25 CPU seconds, so that later interpreters (also where
``PYTHONDONTWRITEBYTECODE`` is set) import torch and megatron-core in ~7 s instead of ~20 s.

Imports every module of ``startrail_megatron`` (its adapters pull in the megatron-core,
DeepSpeed and transformers modules they use), what the test harness preloads
(``tests/harness.py``'s ``PRELOAD``), the model classes the tests build, and the test tools. A module whose optional dependency is missing (flash-attn, transformer-engine:
CUDA only) is skipped; any other import error fails the setup.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import warnings
from pathlib import Path

# Optional backends, imported lazily by the project; absent on CPU machines.
OPTIONAL = ("flash_attn", "transformer_engine", "apex", "triton")

EXTRA = (  # beside PRELOAD, which holds the trainer's lazy imports and the tests' model families
    "pytest",
    "numpy",
    "matplotlib.pyplot",
    "torch.profiler._cupti_monitor",
    "transformers.models.auto.modeling_auto",
)


def _import(name: str, release_specific: bool = False) -> None:
    """``release_specific``: ``name`` may be absent from this megatron-core release (the
    harness preloads some of one release only); a module it imports that is missing still
    fails."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing.split(".")[0] in OPTIONAL:
            return
        if release_specific and (name == missing or name.startswith(missing + ".")):
            return
        raise


def main() -> int:
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("compile_imports.py: unset PYTHONDONTWRITEBYTECODE to run this", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")
    import startrail_megatron

    prefix = startrail_megatron.__name__ + "."
    for mod in pkgutil.walk_packages(startrail_megatron.__path__, prefix):
        if mod.name.endswith(".__main__"):
            continue
        _import(mod.name)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from harness import PRELOAD  # the standard library only, at import

    for name in PRELOAD:
        _import(name, release_specific=True)
    for name in EXTRA:
        _import(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
