"""Which kernel runs: the names, the choice, building and resolving a kernel.

Selection (``choose_kernel``, pure): an explicit name is checked against the
inputs (``capabilities.unsupported_reason``) and raises if it cannot run them;
``"auto"`` takes the first of ``AUTO_ORDER[device]`` that supports (device, dtype,
head_dim, compute capability) and is installed; float64 always gets the exact
``"torch"`` kernel. The ``STARTRAIL_KERNEL`` environment variable replaces ``"auto"``.
``"te"`` is never chosen by ``"auto"``: ask for it by name or ``STARTRAIL_KERNEL=te``.
Each third-party library is imported only when its kernel is built (``build_kernel``).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .capabilities import (
    BACKENDS,
    KERNEL_CLASSES,
    KernelQuery,
    kernel_unsupported_reason,
    module_installed,
    unsupported_reason,
)
from .contract import AttentionKernel
from .reference import TorchKernel
from .sdpa import SdpaKernel

__all__ = [
    "AUTO_ORDER",
    "KERNELS",
    "KERNEL_ENV",
    "KERNEL_NAMES",
    "build_kernel",
    "choose_kernel",
    "get_kernel",
    "resolve_kernel",
]

KERNEL_ENV = "STARTRAIL_KERNEL"
"""Environment variable that replaces ``kernel="auto"`` (any name of ``KERNEL_NAMES``)."""

KERNEL_NAMES: tuple[str, ...] = ("auto", *BACKENDS)

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch"),
    "cpu": ("sdpa", "torch"),
}
"""Candidates of ``"auto"`` per device type, fastest first (others: ``("torch",)``).

``"te"`` is left out on purpose: its adapter has run only against stand-ins."""


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
    installed: Callable[[str], bool] = module_installed,
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
    installed: Callable[[str], bool] = module_installed,
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


_CONSTRUCTORS: dict[str, Callable[[], Any]] = {cls.spec.name: cls for cls in KERNEL_CLASSES}

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


_WARNED: set[str] = set()
"""Reasons ``resolve_kernel`` has warned of a fallback to the reference kernel on a GPU."""


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
        why = kernel_unsupported_reason(kernel, **features)
        if why is not None and _resolve_name(requested, os.environ)[0] == "auto":
            kernel = get_kernel("torch", q.dtype, device=q.device, head_dim=q.shape[-1])
            if q.device.type == "cuda" and why not in _WARNED:  # said once per reason
                _WARNED.add(why)
                warnings.warn(
                    f"kernel='auto' runs StarTrail's reference kernel ('torch') on the GPU: "
                    f"{why}. It builds each call's whole score matrix in fp32 (memory grows "
                    "with the square of the call's length): install flash-attn for windows "
                    "and soft-capping, or bound the calls with tile=",
                    stacklevel=2,
                )
    # the instance decides too (flash-attn 2.5 has no softcap), before any transfer
    why = kernel_unsupported_reason(kernel, **features)
    if why is not None:
        raise NotImplementedError(why)
    return kernel, scale
