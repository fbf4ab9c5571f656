"""Transformer Engine's cuDNN fused attention behind the kernel contract (``"te"``).

Calls ``transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd`` /
``fused_attn_bwd`` (TE 1.9 - 2.18), the functions TE's own context-parallel
ring (``AttnFuncWithCPAndKVP2P``) calls; they return and take the softmax
log-sum-exp (``aux_ctx_tensors[0]``, ``[b, h, sq, 1]`` fp32). Their
parameters changed in almost every minor release, so the adapter reads
parameter names (``signatures.param_names``) and refuses any parameter it
does not know, or a missing one it needs. Layout ``"sbhd_sbhd_sbhd"`` takes
our ``[s, b, h, d]`` tensors as they are (made contiguous: TE reads a pointer
and a shape); GQA natively. Transformer Engine is imported only when
``TEKernel`` is built.

The signatures per release, the auxiliary tensors and masks, as read from TE's
sources: ``docs/kernels.md``.
"""

from __future__ import annotations

from .api import TEFusedAttnAPI, detect_te_api
from .bands import te_band_pieces
from .kernel import TEKernel
from .limits import te_thd_unsupported_reason
from .thd_stats import te_max_tokens

__all__ = [
    "TEFusedAttnAPI",
    "te_band_pieces",
    "TEKernel",
    "detect_te_api",
    "te_max_tokens",
    "te_thd_unsupported_reason",
]
