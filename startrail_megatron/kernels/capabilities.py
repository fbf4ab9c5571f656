"""What each kernel can run, read from the kernel classes' declarations.

Every kernel implements ``contract.AttentionKernel`` and declares what it runs in its
``spec`` (``spec.BackendSpec``); ``BACKENDS`` is the table of those declarations:

========================  ====================================================
name                      what runs (module)
========================  ====================================================
``"flash_attn"``          flash-attn 2 (2.5 - 2.8) (``flash_attn``). CUDA
                          sm80+, fp16/bf16, head_dim % 8 == 0 and <= 256,
                          GQA natively.
``"sdpa_flash"``          ``aten._scaled_dot_product_flash_attention`` (+ its
                          backward) (``sdpa``). CUDA sm80+, fp16/bf16, GQA
                          natively.
``"sdpa_cudnn"``          ``aten._scaled_dot_product_cudnn_attention`` (+ its
                          backward) (``sdpa``). CUDA sm80+, cuDNN >= 9,
                          fp16/bf16, head_dim <= 128. KV heads expanded for GQA.
``"sdpa_efficient"``      ``aten._scaled_dot_product_efficient_attention``
                          (+ its backward) (``sdpa``). CUDA, fp32/fp16/bf16. KV
                          heads expanded for GQA (a view when no copy is needed).
``"te"``                  Transformer Engine 1.9 - 2.18, the cuDNN fused
                          attention its context-parallel ring uses (``te``).
                          CUDA sm80+, cuDNN >= 9, fp16/bf16, head_dim % 8 == 0
                          and <= 128 (<= 256 on sm90 with cuDNN >= 9.5), GQA
                          natively. Tested against stand-ins with TE's exact
                          signatures, never run on a GPU.
``"sdpa"``, ``"torch"``   ``sdpa.SdpaKernel`` / ``reference.TorchKernel``.
========================  ====================================================

``unsupported_reason`` says why a backend cannot run a ``KernelQuery`` (it also applies
a spec's further ``limits``: TE's F16_arbitrary_seqlen limits, training, sbhd, no bias:
sm80+, cuDNN >= 9, head_dim); ``kernel_unsupported_reason`` says why a built kernel
object cannot run a call's features.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .flash_attn import FlashAttnKernel
from .reference import TorchKernel
from .sdpa import SdpaCudnnKernel, SdpaEfficientKernel, SdpaFlashKernel, SdpaKernel
from .spec import BackendSpec
from .te import TEKernel

__all__ = [
    "BACKENDS",
    "KERNEL_CLASSES",
    "KernelQuery",
    "kernel_unsupported_reason",
    "kernels_with",
    "module_installed",
    "unsupported_reason",
]

KERNEL_CLASSES: tuple[type, ...] = (
    TorchKernel,
    SdpaKernel,
    FlashAttnKernel,
    SdpaFlashKernel,
    SdpaCudnnKernel,
    SdpaEfficientKernel,
    TEKernel,
)
"""Every kernel class, in the order of ``BACKENDS`` (and of the names in messages)."""

BACKENDS: dict[str, BackendSpec] = {cls.spec.name: cls.spec for cls in KERNEL_CLASSES}
"""Each kernel name's ``BackendSpec``, as its class declares it."""


@dataclass(frozen=True)
class KernelQuery:
    """The facts selection looks at (built by ``KernelQuery.of`` or by hand in tests).

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        dtype: the input dtype (``None``: not known, no dtype check).
        head_dim: the head dimension (``None``: not known).
        capability: CUDA compute capability (``None`` off CUDA).
        cudnn_version: ``torch.backends.cudnn.version()`` (``None``: no cuDNN).
        dropout: the call has attention dropout.
        window, softcap: the call has a sliding window / logit soft-capping.
    """

    device_type: str = "cpu"
    dtype: torch.dtype | None = None
    head_dim: int | None = None
    capability: tuple[int, int] | None = None
    cudnn_version: int | None = None
    dropout: bool = False
    window: bool = False
    softcap: bool = False

    @classmethod
    def of(
        cls,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        head_dim: int | None,
        dropout: bool = False,
        window: bool = False,
        softcap: bool = False,
    ) -> KernelQuery:
        """Read capability and cuDNN version of ``device`` from the running torch."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        cap = cudnn = None
        if dev.type == "cuda" and torch.cuda.is_available():
            cap = tuple(torch.cuda.get_device_capability(dev))
            if torch.backends.cudnn.is_available():
                cudnn = torch.backends.cudnn.version()
        return cls(dev.type, dtype, head_dim, cap, cudnn, dropout, window, softcap)  # type: ignore[arg-type]


@functools.cache
def module_installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (cached per process)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_FEATURES = (
    ("dropout", "attention dropout"),
    ("window", "sliding windows"),
    ("softcap", "logit soft-capping"),
)
"""The call features a ``BackendSpec`` declares, and their names in messages."""


def unsupported_reason(
    name: str, query: KernelQuery, installed: Callable[[str], bool] = module_installed
) -> str | None:
    """Why backend ``name`` cannot run ``query`` (``None``: it can). Pure given ``installed``."""
    spec = BACKENDS[name]
    if query.device_type not in spec.devices:
        return f"runs on {sorted(spec.devices)}, not {query.device_type!r}"
    if query.dtype is not None and query.dtype not in spec.dtypes:
        allowed = sorted(str(d).removeprefix("torch.") for d in spec.dtypes)
        return f"takes {allowed}, not {str(query.dtype).removeprefix('torch.')}"
    if query.head_dim is not None:
        if spec.max_head_dim is not None and query.head_dim > spec.max_head_dim:
            return f"head_dim {query.head_dim} > {spec.max_head_dim}"
        if query.head_dim % spec.head_dim_multiple:
            return f"head_dim {query.head_dim} is not a multiple of {spec.head_dim_multiple}"
    if spec.min_capability is not None and query.device_type == "cuda":
        if query.capability is None or query.capability < spec.min_capability:
            return f"needs compute capability >= {spec.min_capability}, got {query.capability}"
    if spec.min_cudnn is not None and (
        query.cudnn_version is None or query.cudnn_version < spec.min_cudnn
    ):
        return f"needs cuDNN >= {spec.min_cudnn}, got {query.cudnn_version}"
    for feature, what in _FEATURES:
        if getattr(query, feature) and not getattr(spec, feature):
            return f"does not run {what} (kernels that do: {kernels_with(feature)})"
    if spec.limits is not None:
        why = spec.limits(query.capability, query.cudnn_version, query.head_dim)
        if why is not None:
            return why
    if spec.module is not None and not installed(spec.module):
        return f"the {spec.module!r} package is not installed"
    return None


def kernels_with(feature: str) -> str:
    """The names of the kernels whose ``BackendSpec`` runs ``feature`` (``"dropout"``,
    ``"window"``, ``"softcap"``), comma-separated."""
    return ", ".join(n for n, sp in BACKENDS.items() if getattr(sp, feature))


def kernel_unsupported_reason(kernel, *, dropout: bool, window: bool, softcap: bool) -> str | None:
    """Why this kernel object cannot run the call's features, or ``None``: its
    ``supports_*`` flags (flash-attn 2.5 has no softcap), and flash-attn's refusal of
    soft-capping with dropout (``Softcapping does not support dropout``)."""
    name = getattr(kernel, "name", type(kernel).__name__)
    for needed, attr, what, setting in (
        (dropout, "supports_dropout", "dropout", "dropout_p > 0"),
        (window, "supports_band", "window", "window"),
        (softcap, "supports_softcap", "softcap", "softcap"),
    ):
        if needed and not getattr(kernel, attr, False):
            why = getattr(kernel, attr.removeprefix("supports_") + "_unsupported_reason", None)
            why = f" ({why})" if why else ""
            return (
                f"kernel {name!r} does not run {setting}{why}; it needs one of: "
                f"{kernels_with(what)}"
            )
    if dropout and softcap and not getattr(kernel, "softcap_with_dropout", True):
        return f"kernel {name!r} does not run softcap together with dropout_p > 0; use 'torch'"
    return None
