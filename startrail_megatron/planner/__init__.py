"""Cost model, planner and autotuner for StarTrail's team size and placement.

Entry points:
  predict(strategy, cluster, shape, model)   time, bytes, memory of one strategy
  plan(cluster, model, seq_len, cp_size)     every candidate, ranked, with a recommendation
  autotune(candidates, run_trial)            pick by measuring (``--startrail-team-size auto``)
  fit_cluster(measurements)                  calibrate a ClusterSpec from benchmark JSON
  CLUSTER_PRESETS, MODEL_PRESETS             documented presets
CLI: ``startrail-plan`` / ``python -m startrail_megatron.planner``.
"""

from .autotune import AutotuneResult, Trial, autotune, startrail_candidates
from .calibrate import TORCH_CPU_FLASH_Q_BLOCKS, fit_cluster, fit_linear
from .cluster import CLUSTER_PRESETS, MODEL_PRESETS, ClusterSpec, ModelSpec
from .compute import kv_stream_bytes
from .paper import paper_comm_bytes, paper_memory_units
from .plan import Plan, plan
from .prediction import Prediction, predict
from .shape import AttnShape
from .strategies import (
    KINDS,
    Strategy,
    buffer_bytes,
    candidate_strategies,
    comm_bytes,
    comm_calls,
    memory_bytes,
)

__all__ = [
    "AttnShape",
    "KINDS",
    "AutotuneResult",
    "Plan",
    "TORCH_CPU_FLASH_Q_BLOCKS",
    "Trial",
    "autotune",
    "fit_cluster",
    "fit_linear",
    "plan",
    "startrail_candidates",
    "CLUSTER_PRESETS",
    "ClusterSpec",
    "MODEL_PRESETS",
    "ModelSpec",
    "Prediction",
    "Strategy",
    "buffer_bytes",
    "candidate_strategies",
    "comm_bytes",
    "comm_calls",
    "kv_stream_bytes",
    "memory_bytes",
    "paper_comm_bytes",
    "paper_memory_units",
    "predict",
]
