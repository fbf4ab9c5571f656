"""StarTrail in DeepSpeed: a ``"startrail"`` config section, groups mapped onto ZeRO.

Entry points:
  initialize(...)                      ``deepspeed.initialize`` with StarTrail (same signature)
  python -m startrail_megatron.deepspeed.launch train.py --deepspeed_config ds.json
                                       an unmodified script's ``deepspeed.initialize`` gets it
  StarTrailConfig                      the validated ``"startrail"`` section
  StarTrailMPU                         the groups handed to DeepSpeed (``mpu=``)
  prepare_hf_model / StarTrailDataLoaderAdapter / shard_causal_lm_batch
                                       transformers causal LMs and their data
  patch.patch / patch.unpatch          the opt-in, reversible ``deepspeed.initialize`` patch
  save_checkpoint / load_checkpoint   the engine's checkpoints, atomic, checksummed, loaded
                                       weights-only (``checkpoint.py``)
  dit.run_training                     the DiT trainer's DeepSpeed path (``python -m
                                       startrail_megatron.dit.train --deepspeed-config``)
"""

from . import patch
from .batches import StarTrailDataLoaderAdapter, shard_causal_lm_batch
from .checkpoint import load_checkpoint, save_checkpoint
from .config import StarTrailConfig
from .entry import initialize
from .hf import HFHandle, prepare_hf_model, startrail_hf_attention
from .mpu import StarTrailMPU

__all__ = [
    "HFHandle",
    "StarTrailConfig",
    "StarTrailDataLoaderAdapter",
    "StarTrailMPU",
    "patch",
    "initialize",
    "load_checkpoint",
    "prepare_hf_model",
    "save_checkpoint",
    "shard_causal_lm_batch",
    "startrail_hf_attention",
]
