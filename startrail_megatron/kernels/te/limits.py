"""What Transformer Engine's fused attention (F16_arbitrary_seqlen) can run: devices,
dtypes and shapes of the inputs, window bands, packed (THD) sequences."""

from __future__ import annotations

import torch
from torch import Tensor

_TE_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Device types ``TEKernel`` accepts. Only the tests widen it (to run stand-ins on CPU)."""
_TE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
"""Input dtypes ``TEKernel`` accepts (F16_arbitrary_seqlen). Only the tests widen it."""


_TE_BAND_MIN_CUDNN = 90600  # cuDNN's diagonal band right bound (TE: "9.6: SWA (left, right)")
_TE_BAND_BAD_CUDNN = frozenset({91400})  # TE: no non-causal window with > 1024 keys on 9.14.0
_TE_BAND_MIN_RELEASE = (2, 16)  # TE's backend table: NO_MASK + (left, right) windows


def _te_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a TE version string ("2.16.0", "2.16.0.dev0+abc"), or None."""
    parts = str(version).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


_TE_THD_MIN_CAPABILITY = (9, 0)
_TE_THD_MIN_CUDNN = 90600


def te_thd_unsupported_reason(capability, cudnn_version) -> str | None:
    """Why TE cannot run THD (packed) F16 attention for every head layout and causal
    window StarTrail uses, or ``None``. TE's backend selection (``fused_attn.cpp``) takes
    ``"thd_thd_thd"`` on F16_arbitrary_seqlen from sm90 and cuDNN 9.1 with equal q and kv
    heads, 9.6 with GQA; cuDNN 9.2 - 9.5 refuse THD with the causal window (-1, 0)."""
    if capability is None or tuple(capability) < _TE_THD_MIN_CAPABILITY:
        return f"THD needs compute capability >= {_TE_THD_MIN_CAPABILITY}, got {capability}"
    if cudnn_version is None or cudnn_version < _TE_THD_MIN_CUDNN:
        return f"THD needs cuDNN >= {_TE_THD_MIN_CUDNN}, got {cudnn_version}"
    return None


def _check_te_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.device.type not in _TE_DEVICES:
        raise NotImplementedError(
            f"kernel 'te' runs on {sorted(_TE_DEVICES)} tensors, not {q.device.type!r}"
        )
    if q.dtype not in _TE_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(
            f"kernel 'te' takes q, k, v of one dtype in "
            f"{sorted(str(d).removeprefix('torch.') for d in _TE_DTYPES)}; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    # TE reads the batch size and head_dim from q's shape only: check k, v agree.
    if (
        q.shape[2] % k.shape[2]
        or k.shape != v.shape
        or (q.shape[1], q.shape[3]) != (k.shape[1], k.shape[3])
    ):
        raise ValueError(
            f"kernel 'te': q {tuple(q.shape)} and k/v {tuple(k.shape)}, {tuple(v.shape)} "
            "must share batch and head_dim, k and v one shape, q heads a multiple of k heads"
        )
