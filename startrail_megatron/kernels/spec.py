"""What a kernel class declares it can run: its ``BackendSpec``.

Every kernel class of this package carries ``spec = BackendSpec(name, ...)``; the
selection table (``capabilities.BACKENDS``) is read from those declarations, and the
kernels' ``supports_*`` flags are taken from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ALL_FLOAT", "HALF", "BackendSpec"]

HALF: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
"""fp16 and bf16, the dtypes of the fused CUDA kernels."""
ALL_FLOAT: frozenset[torch.dtype] = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16}
)
"""Every float dtype."""


@dataclass(frozen=True)
class BackendSpec:
    """What a backend can run; ``capabilities.unsupported_reason`` reads it.

    Attributes:
        name: the kernel name users pass.
        devices: device types it runs on.
        dtypes: input dtypes it accepts.
        module: a Python module that must be installed (``None``: torch alone).
        max_head_dim: largest head_dim (``None``: no limit).
        head_dim_multiple: head_dim must be a multiple of this.
        min_capability: lowest CUDA compute capability.
        min_cudnn: lowest cuDNN version (``torch.backends.cudnn.version()``).
        dropout: it runs attention dropout (``contract.Dropout``).
        window: it runs banded calls (``band=``: sliding windows).
        softcap: it runs logit soft-capping (``softcap=``).
        limits: further limits beyond these fields, ``(capability, cudnn_version,
            head_dim) -> why it cannot run them`` (``None``: it can), applied after the
            features and before ``module`` (``None``: no further limits).
    """

    name: str
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    module: str | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    min_capability: tuple[int, int] | None = None
    min_cudnn: int | None = None
    dropout: bool = True
    window: bool = False
    softcap: bool = False
    limits: Callable[[tuple[int, int] | None, int | None, int | None], str | None] | None = None
