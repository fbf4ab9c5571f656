"""The side-by-side benchmark, ``startrail-bench``: StarTrail (every C, both placements),
ring, all-gather-KV and Ulysses on the same inputs and ranks.

What is measured and how: ``cli.py``'s docstring (the ``--help`` text).

  cli.py     the command: arguments, spawned gloo ranks or torchrun, the outputs
  runner.py  one rank: each strategy checked against float64, its bytes, peak
             memory and timed rounds
  rows.py    a strategy's row of the report; the cost model calibrated and its predictions
  micro.py   the microbenchmarks the cost model is calibrated on
  timed_kernel.py  a kernel whose calls wait their modelled time (``--timed-kernels``)
  emulated.py  ``--emulate``: the run on an emulated multi-node cluster
  memory.py  ``PeakMemory``: CUDA allocator, live tensors, PyTorch's MemTracker or RSS
  step_memory.py, step_memory_report.py  ``--workload memory``: the whole step's memory
  report.py  the table and the PNG chart
"""

from .cli import WORKLOADS, build_parser, main, resolve_workload, run
from .memory import PeakMemory
from .micro import cache_bytes_per_core
from .report import format_table, write_png
from .runner import run_rank

__all__ = [
    "WORKLOADS",
    "PeakMemory",
    "build_parser",
    "cache_bytes_per_core",
    "format_table",
    "main",
    "resolve_workload",
    "run",
    "run_rank",
    "write_png",
]
