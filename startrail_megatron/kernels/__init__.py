"""Local attention kernels behind one contract, and how one is chosen.

Modules (imports run down this list, never back up):

  contract      the ``AttentionKernel`` Protocol (and ``VarlenAttentionKernel``),
                ``acc_dtype``, ``merge_partial``
  signatures    parameter names of third-party functions (adapters' version detection)
  spec          ``BackendSpec``: what a kernel class declares it runs (its ``spec``)
  reference     ``TorchKernel`` (``"torch"``): pure PyTorch, float64-capable, exact
  sdpa          PyTorch's fused SDPA ops: ``"sdpa"`` (CPU), ``"sdpa_flash"``,
                ``"sdpa_cudnn"``, ``"sdpa_efficient"`` (CUDA)
  flash_attn    ``"flash_attn"``: flash-attn 2 (imported lazily)
  te            ``"te"``: Transformer Engine's fused attention (imported lazily), a
                package: ``limits``, ``bands``, ``thd_stats``, ``api``, ``kernel``
  capabilities  ``BACKENDS`` (the kernel classes' specs), ``KernelQuery``,
                ``unsupported_reason``; why a kernel object refuses a call's features
  choice        names, ``choose_kernel``, ``build_kernel``, ``get_kernel``,
                ``resolve_kernel``, the ``$STARTRAIL_KERNEL`` override

``get_kernel("auto")`` picks the fastest available for the inputs;
``$STARTRAIL_KERNEL`` overrides ``"auto"``.
"""

from __future__ import annotations

from .capabilities import BACKENDS, KernelQuery, unsupported_reason
from .choice import (
    AUTO_ORDER,
    KERNEL_ENV,
    KERNEL_NAMES,
    KERNELS,
    build_kernel,
    choose_kernel,
    get_kernel,
    resolve_kernel,
)
from .contract import (
    AttentionKernel,
    Dropout,
    VarlenAttentionKernel,
    acc_dtype,
    has_varlen,
    lse_to_bhs,
    merge_partial,
)
from .flash_attn import FlashAttnAPI, FlashAttnKernel, detect_flash_attn_api
from .reference import TorchKernel, dropout_keep
from .sdpa import SdpaCudnnKernel, SdpaEfficientKernel, SdpaFlashKernel, SdpaKernel
from .spec import BackendSpec
from .te import TEFusedAttnAPI, TEKernel, detect_te_api

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "KERNELS",
    "KERNEL_ENV",
    "KERNEL_NAMES",
    "AttentionKernel",
    "BackendSpec",
    "Dropout",
    "FlashAttnAPI",
    "FlashAttnKernel",
    "KernelQuery",
    "SdpaCudnnKernel",
    "SdpaEfficientKernel",
    "SdpaFlashKernel",
    "SdpaKernel",
    "TEFusedAttnAPI",
    "TEKernel",
    "TorchKernel",
    "VarlenAttentionKernel",
    "acc_dtype",
    "build_kernel",
    "choose_kernel",
    "detect_flash_attn_api",
    "detect_te_api",
    "dropout_keep",
    "get_kernel",
    "has_varlen",
    "lse_to_bhs",
    "merge_partial",
    "resolve_kernel",
    "unsupported_reason",
]
