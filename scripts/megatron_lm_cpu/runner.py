"""Run a module like ``python -m``, with CUDA emulated on the CPU (``cuda_on_cpu.py``).

    python scripts/megatron_lm_cpu/runner.py [--megatron-lm DIR] -m MODULE [ARGS...]

``run.sh`` starts one per rank under ``torchrun``, with ``--megatron-lm`` the Megatron-LM
tree and ``-m startrail_megatron.launch DIR/pretrain_gpt.py ...``. The order matters:
the emulation is installed before anything imports Megatron-LM (its modules ask CUDA at
import), then Megatron-LM's training package is prepared for CPU ranks, at run time, in
this process only (its files are left as they are):

* the dataset index helpers: Megatron-LM compiles ``helpers.cpp`` into its own tree on
  rank 0 (``make``, which needs a compiler, pybind11 and ``python3-config``). The prebuilt
  extension of the interpreter's megatron-core wheel is loaded instead, on every rank, as
  ``megatron.core.datasets.helpers_cpp``, and ``compile_helpers`` does nothing. A tree
  that has its own built extension keeps it;
* the fused kernels of ``megatron.legacy`` (up to 0.16): ``fused_kernels.load`` runs
  ``$CUDA_HOME/bin/nvcc -V`` and makes a build folder in the tree; it does nothing here
  (none of those kernels runs on a CPU);
* the JIT warm-up (``_warmup_jit_function``) runs with the RNG state saved and restored.
  On a GPU its ``torch.rand`` and dropout draws advance only CUDA's generator; emulated,
  CUDA's generator is the CPU one, and the number of draws depends on the context-parallel
  size (its tensors are ``seq_length // cp_size`` long), so without this the weights made
  after it would differ between CP sizes;
* ``typing.override`` (Python 3.12) is defined on older Pythons: Megatron-LM from 0.18
  imports it, and declares Python >= 3.12 from 0.17.

Without ``--megatron-lm`` only the emulation is installed.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import runpy
import sys
import sysconfig
import typing

import cuda_on_cpu
import torch

USAGE = "usage: runner.py [--megatron-lm DIR] -m MODULE [ARGS...]"
_HELPERS = "megatron.core.datasets.helpers_cpp"


def _prebuilt_helpers() -> str:
    """The path of the dataset helpers extension in the interpreter's megatron-core wheel."""
    name = "megatron/core/datasets/helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX")
    try:
        path = str(importlib.metadata.distribution("megatron-core").locate_file(name))
    except importlib.metadata.PackageNotFoundError:
        path = ""
    if not os.path.isfile(path):
        sys.exit(
            f"runner.py: {sys.executable} has no megatron-core wheel with a built {name} "
            "(pip install megatron-core, or build it in the Megatron-LM tree: "
            "make -C megatron/core/datasets)"
        )
    return path


def _load_extension(name: str, path: str) -> None:
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module


def prepare_megatron_lm(tree: str) -> None:
    """Ready the Megatron-LM training package of ``tree`` for CPU ranks (module docstring)."""
    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        typing.override = lambda f: f
    tree = os.path.abspath(tree)
    sys.path.insert(0, tree)  # the launcher puts the script's folder first too
    from megatron.core.datasets import utils as datasets_utils
    from megatron.training import initialize

    if not os.path.realpath(initialize.__file__).startswith(os.path.realpath(tree) + os.sep):
        sys.exit(f"runner.py: megatron.training came from {initialize.__file__}, not {tree}")

    if importlib.util.find_spec(_HELPERS) is None:
        _load_extension(_HELPERS, _prebuilt_helpers())
    datasets_utils.compile_helpers = lambda: None

    if hasattr(initialize, "fused_kernels"):
        initialize.fused_kernels.load = lambda args: None

    warmup = initialize._warmup_jit_function

    @functools.wraps(warmup)
    def rng_neutral_warmup(*args, **kwargs):  # 0.19 passes tp_size=
        with torch.random.fork_rng(devices=[]):
            return warmup(*args, **kwargs)

    initialize._warmup_jit_function = rng_neutral_warmup


def report_subgroups() -> None:
    """With ``MLM_CPU_REPORT_SUBGROUPS=1``: at exit each rank prints the hybrid-CP sub-groups
    its StarTrail attention ran on (size: calls, bytes sent by this rank), the proof that
    ``--hybrid-context-parallel`` used them."""
    import atexit
    import collections

    from startrail_megatron.megatron import attention

    calls, states = collections.Counter(), {}
    pick = attention.subgroup_state

    def counting(group, size):
        state = states[size] = pick(group, size)
        calls[size] += 1
        return state

    attention.subgroup_state = counting

    def report():
        rank = os.environ.get("RANK", "?")
        sizes = ", ".join(
            f"{k} ranks: {calls[k]} calls, {states[k].ledger.bytes()} bytes" for k in sorted(calls)
        )
        print(f"[rank {rank}] StarTrail hybrid-CP sub-groups: {sizes or 'none'}", flush=True)

    atexit.register(report)


def main(argv: list[str]) -> None:
    tree = None
    if argv[:1] == ["--megatron-lm"] and len(argv) > 1:
        tree, argv = argv[1], argv[2:]
    if len(argv) < 2 or argv[0] != "-m":
        sys.exit(USAGE)
    module, args = argv[1], argv[2:]
    sys.path[0] = os.getcwd()  # as ``python -m``: the current folder, not this script's
    cuda_on_cpu.install()
    if tree is not None:
        prepare_megatron_lm(tree)
    if os.environ.get("MLM_CPU_REPORT_SUBGROUPS") == "1":
        report_subgroups()
    sys.argv = [module, *args]  # argv[0] becomes the module's file, as with ``python -m``
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
