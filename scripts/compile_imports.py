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

EXTRA = (
    "pytest",
    "numpy",
    "matplotlib.pyplot",
    "megatron.core.datasets.blended_megatron_dataset_builder",  # the trainer's, lazily
    "megatron.core.datasets.helpers",
    "torch.profiler._cupti_monitor",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.gemma2.modeling_gemma2",
    "transformers.models.gpt_oss.modeling_gpt_oss",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.auto.modeling_auto",
)


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
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

    for name in (*PRELOAD, *EXTRA):
        _import(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
