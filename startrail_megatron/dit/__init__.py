"""Diffusion transformers on StarTrail: a small DiT / MMDiT (``model``), token sharding,
the attention wrapper, the group RNG check and the loss scale (``parallel``), and the
trainer: its data (``data``), settings and training loop (``loop``) and command line
(``python -m startrail_megatron.dit.train``). Plain PyTorch; DeepSpeed optional."""

from .model import DiT, DiTConfig, patchify, unpatchify
from .parallel import (
    DiTHandle,
    StarTrailSDPA,
    TokenSharding,
    check_replicated,
    diffusion_loss,
    parallelize_dit,
    unwrap_attention,
    wrap_attention,
)

__all__ = [
    "DiT",
    "DiTConfig",
    "DiTHandle",
    "StarTrailSDPA",
    "TokenSharding",
    "check_replicated",
    "diffusion_loss",
    "parallelize_dit",
    "patchify",
    "unpatchify",
    "unwrap_attention",
    "wrap_attention",
]
