"""Which kernel runs: the names, what each can run, and the choice.

Every kernel implements ``contract.AttentionKernel``; each third-party library
is imported only when its kernel is built (``build_kernel``).

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
                          natively. Explicit only (not in ``AUTO_ORDER``):
                          tested against stand-ins with TE's exact
                          signatures, never run on a GPU.
``"sdpa"``, ``"torch"``   ``sdpa.SdpaKernel`` / ``reference.TorchKernel``.
========================  ====================================================

Selection (``choose_kernel``, pure): an explicit name is checked against the
inputs and raises if it cannot run them; ``"auto"`` takes the first of
``AUTO_ORDER[device]`` that supports (device, dtype, head_dim, compute
capability) and is installed; float64 always gets the exact ``"torch"``
kernel. The ``STARTRAIL_KERNEL`` environment variable replaces ``"auto"``.
``"te"`` is never chosen by ``"auto"``: ask for it by name or ``STARTRAIL_KERNEL=te``.
``unsupported_reason`` also applies TE's F16_arbitrary_seqlen limits (training,
sbhd, no bias: sm80+, cuDNN >= 9, head_dim).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .contract import AttentionKernel
from .flash_attn import FlashAttnKernel
from .reference import TorchKernel
from .sdpa import SdpaCudnnKernel, SdpaEfficientKernel, SdpaFlashKernel, SdpaKernel
from .te import TEKernel

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "KERNELS",
    "KERNEL_ENV",
    "KERNEL_NAMES",
    "BackendSpec",
    "KernelQuery",
    "build_kernel",
    "choose_kernel",
    "get_kernel",
    "resolve_kernel",
    "unsupported_reason",
]

KERNEL_ENV = "STARTRAIL_KERNEL"
"""Environment variable that replaces ``kernel="auto"`` (any name of ``KERNEL_NAMES``)."""

_HALF = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class BackendSpec:
    """What a backend can run; ``unsupported_reason`` reads it.

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


_ALL_FLOAT = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})

BACKENDS: dict[str, BackendSpec] = {
    s.name: s
    for s in (
        BackendSpec(
            "torch", frozenset({"cpu", "cuda", "meta"}), _ALL_FLOAT, window=True, softcap=True
        ),
        # the CPU flash op has no RNG state to rebuild a mask from
        BackendSpec("sdpa", frozenset({"cpu", "cuda"}), _ALL_FLOAT, dropout=False),
        BackendSpec(
            "flash_attn",
            frozenset({"cuda"}),
            _HALF,
            "flash_attn",
            256,
            8,
            (8, 0),
            window=True,
            softcap=True,
        ),  # fmt: skip (softcap: 2.6+, checked when the kernel is built)
        BackendSpec("sdpa_flash", frozenset({"cuda"}), _HALF, None, 256, 8, (8, 0)),
        BackendSpec("sdpa_cudnn", frozenset({"cuda"}), _HALF, None, 128, 8, (8, 0), 90000),
        BackendSpec(
            "sdpa_efficient",
            frozenset({"cuda"}),
            frozenset({torch.float32, torch.float16, torch.bfloat16}),
            head_dim_multiple=8,
            min_capability=(5, 0),
        ),
        BackendSpec(
            "te",
            frozenset({"cuda"}),
            _HALF,
            "transformer_engine",
            256,
            8,
            (8, 0),
            90000,
            dropout=False,
            window=True,
        ),  # fmt: skip (window: TE 2.12+ and cuDNN 9.6+, checked by the kernel object)
    )
}
KERNEL_NAMES: tuple[str, ...] = ("auto", *BACKENDS)

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch"),
    "cpu": ("sdpa", "torch"),
}
"""Candidates of ``"auto"`` per device type, fastest first (others: ``("torch",)``).

``"te"`` is left out on purpose: its adapter has run only against stand-ins."""


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
def _installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (cached per process)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def unsupported_reason(
    name: str, query: KernelQuery, installed: Callable[[str], bool] = _installed
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
    for feature, what in (
        ("dropout", "attention dropout"),
        ("window", "sliding windows"),
        ("softcap", "logit soft-capping"),
    ):
        if getattr(query, feature) and not getattr(spec, feature):
            return f"does not run {what} (kernels that do: {_kernels_with(feature)})"
    if name == "te":
        why = _te_limits(query)
        if why is not None:
            return why
    if spec.module is not None and not installed(spec.module):
        return f"the {spec.module!r} package is not installed"
    return None


def _te_limits(query: KernelQuery) -> str | None:
    """TE's F16_arbitrary_seqlen limits (``nvte_get_fused_attn_backend``, training,
    sbhd, no bias) beyond the spec: head_dim > 128 only on sm90 with cuDNN >= 9.5;
    Blackwell (sm100+) needs cuDNN >= 9.7."""
    cap, cudnn, d = query.capability, query.cudnn_version, query.head_dim
    if cap is not None and cap >= (10, 0) and (cudnn is None or cudnn < 90700):
        return f"needs cuDNN >= 90700 on compute capability {cap}, got {cudnn}"
    if d is not None and d > 128 and not (cap == (9, 0) and cudnn is not None and cudnn >= 90500):
        return (
            f"head_dim {d} > 128 needs compute capability (9, 0) and cuDNN >= 90500, got "
            f"{cap} and {cudnn}"
        )
    return None


def _resolve_name(name: str, env: Mapping[str, str]) -> tuple[str, str]:
    """(kernel name, the setting it came from); ValueError on an unknown name."""
    setting = "kernel"
    if name == "auto" and env.get(KERNEL_ENV):
        name, setting = env[KERNEL_ENV].strip(), KERNEL_ENV
    if name not in KERNEL_NAMES:
        raise ValueError(f"{setting}={name!r} is not known; allowed: {list(KERNEL_NAMES)}")
    return name, setting


def choose_kernel(
    name: str,
    query: KernelQuery,
    installed: Callable[[str], bool] = _installed,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The kernel names to try, in order, for ``name`` and ``query``. Pure.

    An explicit name gives ``[name]`` or raises ``NotImplementedError`` with the
    reason it cannot run the inputs; ``"auto"`` (or ``$STARTRAIL_KERNEL``) gives
    every supported candidate of ``AUTO_ORDER``, fastest first, ending with
    ``"torch"``. ``ValueError`` names the setting and the allowed values.
    """
    env = os.environ if env is None else env
    name, setting = _resolve_name(name, env)
    if name != "auto":
        why = unsupported_reason(name, query, installed)
        if why is not None:
            raise NotImplementedError(f"{setting}={name!r} cannot run these inputs: {why}")
        return [name]
    if query.dtype == torch.float64:
        return ["torch"]
    order = AUTO_ORDER.get(query.device_type, ("torch",))
    return [n for n in order if unsupported_reason(n, query, installed) is None] or ["torch"]


def build_kernel(
    name: str = "auto",
    dtype: torch.dtype | None = None,
    *,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    env: Mapping[str, str] | None = None,
    query: KernelQuery | None = None,
    installed: Callable[[str], bool] = _installed,
    dropout: bool = False,
    window: bool = False,
    softcap: bool = False,
) -> Any:
    """A kernel object for ``name`` (see ``choose_kernel``), imported lazily.

    With ``"auto"`` a backend whose import fails (a broken install) is skipped.
    ``query`` replaces what ``device``/``dtype``/``head_dim`` would give.
    """
    q = query or KernelQuery.of(device, dtype, head_dim, dropout, window, softcap)
    candidates = choose_kernel(name, q, installed, env)
    errors = []
    for cand in candidates:
        try:
            return _instance(_CONSTRUCTORS[cand])
        except (ImportError, OSError) as e:
            if len(candidates) == 1:
                raise
            errors.append(f"{cand}: {e}")
    raise RuntimeError(f"no attention kernel could be built: {errors}")  # "torch" never fails


@functools.cache
def _instance(constructor: Callable[[], Any]) -> Any:
    """One kernel object per constructor: kernels hold no per-call state, and
    flash-attn's import and signature detection then run once per process."""
    return constructor()


_CONSTRUCTORS: dict[str, Callable[[], Any]] = {
    "torch": TorchKernel,
    "sdpa": SdpaKernel,
    "flash_attn": FlashAttnKernel,
    "sdpa_flash": SdpaFlashKernel,
    "sdpa_cudnn": SdpaCudnnKernel,
    "sdpa_efficient": SdpaEfficientKernel,
    "te": TEKernel,
}

KERNELS: dict[str, type] = {"torch": TorchKernel, "sdpa": SdpaKernel}
"""The kernels that need torch alone; ``KERNEL_NAMES`` lists every name."""


def get_kernel(
    name: str = "auto",
    dtype: torch.dtype | None = None,
    *,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    dropout: bool = False,
    window: bool = False,
    softcap: bool = False,
) -> AttentionKernel:
    """A kernel by name, or the fastest one that runs these inputs.

    Args:
        name: ``"auto"`` or one of ``KERNEL_NAMES`` (``"torch"``,
            ``"sdpa"``, ``"flash_attn"``, ``"sdpa_flash"``, ``"sdpa_cudnn"``,
            ``"sdpa_efficient"``, ``"te"``; ``"te"`` only by name, never by ``"auto"``).
            ``"auto"`` is replaced by ``$STARTRAIL_KERNEL`` when that is set.
        dtype, device, head_dim: the inputs' (device defaults to CPU); ``"auto"``
            picks by them (float64 always gets the exact ``"torch"`` kernel),
            an explicit name raises ``NotImplementedError`` if it cannot run them.
        dropout, window, softcap: the kernel must run attention dropout, sliding windows,
            logit soft-capping.

    Raises:
        ValueError: an unknown name (naming the setting and the allowed values).
    """
    return build_kernel(
        name, dtype, device=device, head_dim=head_dim, dropout=dropout, window=window,
        softcap=softcap,
    )  # fmt: skip


def _kernels_with(feature: str) -> str:
    """The names of the kernels whose ``BackendSpec`` runs ``feature``."""
    return ", ".join(n for n, sp in BACKENDS.items() if getattr(sp, feature))


def _instance_refuses(kernel, *, dropout: bool, window: bool, softcap: bool) -> str | None:
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
                f"{_kernels_with(what)}"
            )
    if dropout and softcap and not getattr(kernel, "softcap_with_dropout", True):
        return f"kernel {name!r} does not run softcap together with dropout_p > 0; use 'torch'"
    return None


def resolve_kernel(
    q: Tensor,
    kernel: str | AttentionKernel,
    softmax_scale: float | None,
    dropout: bool = False,
    window: bool = False,
    softcap: bool = False,
) -> tuple[AttentionKernel, float]:
    """The kernel object and softmax scale an attention call on ``q`` uses.

    A name is looked up with ``get_kernel`` for q's dtype, device and head_dim;
    the scale defaults to ``head_dim ** -0.5``; an explicit one must be a finite
    number > 0 (``ValueError``).
    """
    if softmax_scale is not None:
        bad = isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
        if bad or not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite number > 0 or None")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    features = dict(dropout=dropout, window=window, softcap=softcap)
    if isinstance(kernel, str):
        requested = kernel
        kernel = get_kernel(
            kernel, q.dtype, device=q.device, head_dim=q.shape[-1], **features
        )  # fmt: skip
        why = _instance_refuses(kernel, **features)
        if why is not None and _resolve_name(requested, os.environ)[0] == "auto":
            kernel = get_kernel("torch", q.dtype, device=q.device, head_dim=q.shape[-1])
    # the instance decides too (flash-attn 2.5 has no softcap), before any transfer
    why = _instance_refuses(kernel, **features)
    if why is not None:
        raise NotImplementedError(why)
    return kernel, scale
