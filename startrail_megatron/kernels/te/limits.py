"""What Transformer Engine's fused attention (F16_arbitrary_seqlen) can run beyond the
fields of ``TEKernel.spec``: head_dim and cuDNN per GPU, the inputs' shapes, window
bands, packed (THD) sequences."""

from __future__ import annotations

from torch import Tensor

from ..spec import BackendSpec

__all__ = [
    "TE_SUPPORTED",
    "check_te_inputs",
    "te_band_cudnn_unsupported_reason",
    "te_band_release_unsupported_reason",
    "te_query_unsupported_reason",
    "te_thd_unsupported_reason",
]

TE_SUPPORTED = "Transformer Engine 1.9 - 2.18"
"""The releases whose ``fused_attn_fwd`` / ``fused_attn_bwd`` the adapter has read."""


def te_query_unsupported_reason(capability, cudnn_version, head_dim) -> str | None:
    """TE's F16_arbitrary_seqlen limits (``nvte_get_fused_attn_backend``, training,
    sbhd, no bias) beyond the spec: head_dim > 128 only on sm90 with cuDNN >= 9.5;
    Blackwell (sm100+) needs cuDNN >= 9.7. ``BackendSpec.limits`` of ``TEKernel``."""
    cap, cudnn, d = capability, cudnn_version, head_dim
    if cap is not None and cap >= (10, 0) and (cudnn is None or cudnn < 90700):
        return f"needs cuDNN >= 90700 on compute capability {cap}, got {cudnn}"
    if d is not None and d > 128 and not (cap == (9, 0) and cudnn is not None and cudnn >= 90500):
        return (
            f"head_dim {d} > 128 needs compute capability (9, 0) and cuDNN >= 90500, got "
            f"{cap} and {cudnn}"
        )
    return None


def check_te_inputs(q: Tensor, k: Tensor, v: Tensor, spec: BackendSpec) -> None:
    """Raise unless q, k, v ``[s, b, h, d]`` are on one of ``spec.devices``, of one dtype
    of ``spec.dtypes``, and of shapes TE reads right."""
    if q.device.type not in spec.devices:
        raise NotImplementedError(
            f"kernel 'te' runs on {sorted(spec.devices)} tensors, not {q.device.type!r}"
        )
    if q.dtype not in spec.dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(
            f"kernel 'te' takes q, k, v of one dtype in "
            f"{sorted(str(d).removeprefix('torch.') for d in spec.dtypes)}; got "
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


def te_band_release_unsupported_reason(version: str, fwd_params, bwd_params) -> str | None:
    """Why the TE release ``version`` (its ``fused_attn_fwd`` / ``fused_attn_bwd`` taking
    ``fwd_params`` / ``bwd_params``) cannot run a window band, or ``None``. A band goes as
    ``window_size`` (left, right) with no mask on the top-left diagonal
    (``bottom_right_diagonal=False``). TE's backend table (``fused_attn.cpp``,
    ``nvte_get_fused_attn_backend``) takes no-mask windows with a right side only from
    2.16 (before it, (left, right) only beside padding or bottom-right causal masks, and
    (left, 0) beside a causal one). The signatures of 2.12 - 2.15 and 2.16 cannot tell
    them apart, so the release is read from ``version``."""
    have = _te_release(version)
    ok = have is not None and have >= _TE_BAND_MIN_RELEASE
    if ok and "bottom_right_diagonal" in fwd_params and "bottom_right_diagonal" in set(bwd_params):
        return None
    want = ".".join(map(str, _TE_BAND_MIN_RELEASE))
    return (
        f"window bands (left, right) without a mask need Transformer Engine >= {want} "
        f"(its backend table), got {version}"
    )


def te_band_cudnn_unsupported_reason(cudnn_version: int | None) -> str | None:
    """Why TE cannot run window bands on the cuDNN runtime ``cudnn_version`` (e.g.
    90600; ``None``: none), or ``None``: cuDNN >= 9.6, not 9.14.0."""
    if cudnn_version is None or cudnn_version < _TE_BAND_MIN_CUDNN:
        return (
            f"Transformer Engine window bands (left, right) need cuDNN >= "
            f"{_TE_BAND_MIN_CUDNN}, got {cudnn_version}"
        )
    if cudnn_version in _TE_BAND_BAD_CUDNN:
        return (
            f"Transformer Engine takes no window without a causal mask over more than 1024 "
            f"keys on cuDNN {cudnn_version}; use another cuDNN or kernel"
        )
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
