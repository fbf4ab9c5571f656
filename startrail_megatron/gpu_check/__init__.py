"""One-device check of every attention backend inside StarTrail, and its per-rank efficiency.

``python -m startrail_megatron.gpu_check`` (``scripts/gpu_check.sh``; the command and what
it checks: ``cli.py``). One idea per module:

  sizes      the backends checked and timed, each mode's sizes, the peers' tolerances
  dense      ``check_backend``: one backend's dense forward and backward against float64
  features   ``check_features``: the attention variants (packed, window+softcap, sinks, dropout)
  case       ``FeatureCase``: one backend's variant case (its rows, errors, zigzag run)
  packed     ``check_packed``: packed documents (the varlen / THD path) against float64
  timing     ``time_backend``: StarTrail's per-rank compute against one whole-sequence call
  report     the environment, the ``Report`` written as the JSON, the printed lines
  suite      ``run``: the checks, then the timings, within a time budget
  cli        ``main``: the command line
"""

from .cli import main
from .dense import check_backend
from .features import FEATURES, check_features
from .report import Report
from .sizes import CHECK_BACKENDS, CPU_SIZES, GPU_SIZES, TIMED_BACKENDS, Sizes, tolerance
from .suite import run
from .timing import time_backend

__all__ = [
    "CHECK_BACKENDS",
    "CPU_SIZES",
    "FEATURES",
    "GPU_SIZES",
    "Report",
    "Sizes",
    "TIMED_BACKENDS",
    "check_backend",
    "check_features",
    "main",
    "run",
    "time_backend",
    "tolerance",
]
