"""Transformer Engine's cuDNN fused attention behind the kernel contract (``"te"``).

Calls ``transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd`` /
``fused_attn_bwd`` (TE 1.9 - 2.18), the functions TE's own context-parallel
ring (``AttnFuncWithCPAndKVP2P``) calls; they return and take the softmax
log-sum-exp (``aux_ctx_tensors[0]``, ``[b, h, sq, 1]`` fp32). Their
parameters changed in almost every minor release, so the adapter reads
parameter names (``signatures._param_names``) and refuses any parameter it
does not know, or a missing one it needs. Layout ``"sbhd_sbhd_sbhd"`` takes
our ``[s, b, h, d]`` tensors as they are (made contiguous: TE reads a pointer
and a shape); GQA natively. Transformer Engine is imported only when
``TEKernel`` is built.

The signatures per release, the auxiliary tensors and masks, as read from TE's
sources: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .contract import acc_dtype, varlen_lse_packed, varlen_lse_padded
from .signatures import _param_names

__all__ = [
    "TEFusedAttnAPI",
    "te_band_pieces",
    "TEKernel",
    "detect_te_api",
    "te_max_tokens",
    "te_thd_unsupported_reason",
]

_TE_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Device types ``TEKernel`` accepts. Only the tests widen it (to run stand-ins on CPU)."""
_TE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
"""Input dtypes ``TEKernel`` accepts (F16_arbitrary_seqlen). Only the tests widen it."""

_TE_SUPPORTED = "Transformer Engine 1.9 - 2.18"
_TE_LAYOUT = "sbhd_sbhd_sbhd"  # our [s, b, h, d] tensors, each in its own buffer
_TE_FORMAT = "sbhd"
_TE_THD_LAYOUT = "thd_thd_thd"  # packed sequences: [tokens, h, d] each, int32 cu_seqlens

# Every parameter fused_attn_fwd / fused_attn_bwd have had in TE 1.9 - 2.18. A name
# outside these sets means a release this adapter has not read: its default could
# change what the kernel computes (2.15's dqkv_layout defaults to "sbh3d"), so refuse.
_TE_FWD_KNOWN = frozenset(
    {
        "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv",
        "q", "k", "v", "qkv_dtype", "fake_dtype", "fused_attention_backend", "attn_bias",
        "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k", "page_table_v",
        "d_scale_qkv", "d_scale_qkv_offset", "d_scale_s", "d_scale_s_offset", "q_scale_s",
        "q_scale_s_offset", "q_scale_o", "q_scale_o_offset", "amax_s", "amax_s_offset",
        "amax_o", "amax_o_offset", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
        "fast_zero_fill", "qkv_layout", "o_format", "qkv_scale_inv_format", "attn_bias_type",
        "attn_mask_type", "softmax_type", "window_size", "bottom_right_diagonal", "rng_gen",
        "softmax_offset", "return_max_logit", "cuda_graph",
    }
)  # fmt: skip
_TE_BWD_KNOWN = frozenset(
    {
        "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o",
        "d_o", "qkv_dtype", "fake_dtype", "dqkv_dtype", "aux_ctx_tensors",
        "fused_attention_backend", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
        "d_scale_qkv", "d_scale_s", "d_scale_o", "d_scale_do", "d_scale_dp", "q_scale_s",
        "q_scale_dp", "q_scale_dqkv", "amax_dp", "amax_dqkv", "s_quantizer", "dp_quantizer",
        "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "o_format",
        "do_format", "dqkv_layout", "qkv_scale_inv_format", "do_scale_inv_format",
        "attn_bias_type", "attn_mask_type", "softmax_type", "window_size",
        "bottom_right_diagonal", "deterministic", "cuda_graph",
    }
)  # fmt: skip
_TE_FWD_NEEDED = frozenset(
    {
        "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv",
        "q", "k", "v", "fused_attention_backend", "attn_scale", "dropout", "qkv_layout",
        "attn_bias_type", "attn_mask_type", "window_size",
    }
)  # fmt: skip
_TE_BWD_NEEDED = frozenset(
    {
        "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v",
        "o", "d_o", "aux_ctx_tensors", "fused_attention_backend", "attn_scale", "dropout",
        "qkv_layout", "attn_bias_type", "attn_mask_type", "window_size", "deterministic",
    }
)  # fmt: skip


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (TE's ``cuda_graph``)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _te_fixed_kwargs(
    causal: bool, scale: float, cuda_graph: bool, thd: bool = False, window=None
) -> dict[str, Any]:
    """TE arguments shared by forward and backward: no bias, dropout, sink.

    ``"causal"`` is TE's top-left causal mask (``"causal_bottom_right"`` is the
    other one), the contract's; ``bottom_right_diagonal=False`` is what TE
    derives from it when left ``None``. The window is ``(-1, 0)`` for causal, as
    TE's ``DotProductAttention`` passes it (``check_set_window_size``): TE >= 2.12
    with cuDNN 9.2 - 9.5 finds no backend for a causal mask with ``(-1, -1)``.
    ``cuda_graph``: whether the stream is being captured (``_capturing``), passed on as
    TE's own code does (it changes which backward cuDNN may run). ``thd``: packed sequences
    (``"thd_thd_thd"``), whose masks TE names ``"padding_causal"`` / ``"padding"``
    (top-left causal; TE refuses THD with any mask without padding). ``window``: TE's
    ``window_size`` ``(left, right)`` of a band call (``TEKernel._band_window``): no mask
    and the top-left diagonal, so query i sees keys ``i - left .. i + right``.
    """
    if thd:
        layout, mask = _TE_THD_LAYOUT, ("padding_causal" if causal else "padding")
    else:
        layout, mask = _TE_LAYOUT, ("causal" if causal else "no_mask")
    if window is None:
        window = (-1, 0) if causal else (-1, -1)
    elif causal or thd:
        raise ValueError("a TE window band is a sbhd call without the causal mask")
    return {
        "attn_scale": float(scale),
        "dropout": 0.0,
        "qkv_layout": layout,
        "attn_bias_type": "no_bias",
        "attn_mask_type": mask,
        "softmax_type": "vanilla",
        "window_size": tuple(window),
        "bottom_right_diagonal": False,
        "cuda_graph": bool(cuda_graph),
    }


@dataclass(frozen=True)
class TEFusedAttnAPI:
    """TE's ``fused_attn_fwd`` / ``fused_attn_bwd`` as detected from their signatures.

    Attributes:
        fwd_params, bwd_params: parameter names, in order.
        fwd_required, bwd_required: those without a default.
        dtype_arg: ``"qkv_dtype"`` (1.x: a ``tex.DType``) or ``"fake_dtype"`` (2.x:
            the ``torch.dtype``).
        dqkv_dtype: the backward takes ``dqkv_dtype`` (a ``tex.DType``; 1.9 - 2.14).
        version: ``transformer_engine.__version__`` (messages only).
    """

    fwd_params: tuple[str, ...]
    bwd_params: tuple[str, ...]
    fwd_required: frozenset[str]
    bwd_required: frozenset[str]
    dtype_arg: str
    dqkv_dtype: bool
    version: str = "?"

    @property
    def needs_te_dtype(self) -> bool:
        """Whether dtypes go in as ``tex.DType`` (``constants.TE_DType[...]``)."""
        return self.dtype_arg == "qkv_dtype" or self.dqkv_dtype

    def _kwargs(self, params, required, values: dict[str, Any], which: str) -> dict[str, Any]:
        missing = sorted(n for n in required if n not in values)
        if missing:
            raise NotImplementedError(
                f"Transformer Engine {self.version}: {which} requires {missing}, which this "
                f"adapter does not provide (supported: {_TE_SUPPORTED})"
            )
        return {n: values[n] for n in params if n in values}

    @property
    def band_unsupported_reason(self) -> str | None:
        """Why this TE release cannot run a window band, or ``None``. A band goes as
        ``window_size`` (left, right) with no mask on the top-left diagonal
        (``bottom_right_diagonal=False``). TE's backend table (``fused_attn.cpp``,
        ``nvte_get_fused_attn_backend``) takes no-mask windows with a right side only from
        2.16 (before it, (left, right) only beside padding or bottom-right causal masks,
        and (left, 0) beside a causal one). The signatures of 2.12 - 2.15 and 2.16 cannot
        tell them apart, so the release is read from ``version``. cuDNN's part is
        ``TEKernel.band_unsupported_reason``."""
        have = _te_release(self.version)
        ok = have is not None and have >= _TE_BAND_MIN_RELEASE
        if (
            ok
            and "bottom_right_diagonal" in self.fwd_params
            and "bottom_right_diagonal" in set(self.bwd_params)
        ):
            return None
        want = ".".join(map(str, _TE_BAND_MIN_RELEASE))
        return (
            f"window bands (left, right) without a mask need Transformer Engine >= {want} "
            f"(its backend table), got {self.version}"
        )

    def forward_kwargs(
        self, q, k, v, cu_q, cu_kv, backend, dtype, *, causal, scale, cuda_graph, rng_gen=None,
        thd=None, window=None,
    ):  # fmt: skip
        """Keyword arguments of ``fused_attn_fwd`` for sbhd q, k, v. ``rng_gen``: the
        generator TE draws its (unused, dropout 0) Philox state from. ``thd``:
        ``(max_seqlen_q, max_seqlen_kv)`` of packed THD q, k, v (``cu_q``/``cu_kv``
        then the sequences' offsets, also passed as the padded ones: no gaps).
        ``window``: TE's ``window_size`` of a band call, ``cuda_graph``: whether the
        stream is being captured (``_te_fixed_kwargs``)."""
        values = {
            "is_training": True,  # the softmax statistics come only with training
            "max_seqlen_q": q.shape[0] if thd is None else thd[0],
            "max_seqlen_kv": k.shape[0] if thd is None else thd[1],
            "cu_seqlens_q": cu_q,
            "cu_seqlens_kv": cu_kv,
            "q": q,
            "k": k,
            "v": v,
            self.dtype_arg: dtype,
            "fused_attention_backend": backend,
            **_te_fixed_kwargs(causal, scale, cuda_graph, thd is not None, window),
            "o_format": _TE_FORMAT if thd is None else "thd",
            "return_max_logit": False,
            "rng_gen": rng_gen,
            **_thd_padded(thd, cu_q, cu_kv),
        }
        return self._kwargs(self.fwd_params, self.fwd_required, values, "fused_attn_fwd")

    def backward_kwargs(
        self, d_o, q, k, v, o, aux, cu_q, cu_kv, backend, dtype, dqkv_dtype, *, causal, scale,
        cuda_graph, thd=None, window=None,
    ):  # fmt: skip
        """Keyword arguments of ``fused_attn_bwd`` (``cuda_graph``, ``thd``, ``window`` as in
        ``forward_kwargs``); it returns new dq, dk, dv."""
        fmt = _TE_FORMAT if thd is None else "thd"
        values = {
            "max_seqlen_q": q.shape[0] if thd is None else thd[0],
            "max_seqlen_kv": k.shape[0] if thd is None else thd[1],
            "cu_seqlens_q": cu_q,
            "cu_seqlens_kv": cu_kv,
            "q": q,
            "k": k,
            "v": v,
            "o": o,
            "d_o": d_o,
            self.dtype_arg: dtype,
            "dqkv_dtype": dqkv_dtype,
            "aux_ctx_tensors": aux,
            "fused_attention_backend": backend,
            **_te_fixed_kwargs(causal, scale, cuda_graph, thd is not None, window),
            "o_format": fmt,
            "do_format": fmt,
            "dqkv_layout": _TE_LAYOUT if thd is None else _TE_THD_LAYOUT,
            "deterministic": False,
            **_thd_padded(thd, cu_q, cu_kv),
        }
        return self._kwargs(self.bwd_params, self.bwd_required, values, "fused_attn_bwd")


def _thd_padded(thd, cu_q, cu_kv) -> dict[str, Any]:
    """THD: the padded offsets equal the real ones (the sequences have no gaps)."""
    return {} if thd is None else {"cu_seqlens_q_padded": cu_q, "cu_seqlens_kv_padded": cu_kv}


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


BandPiece = tuple[int, int, int, int, int, int]
"""(q_lo, q_hi, kv_lo, kv_hi, left, right): one TE call on rows [q_lo, q_hi) x keys
[kv_lo, kv_hi) with ``window_size=(left, right)`` on the top-left diagonal (-1: unbounded)."""


@functools.lru_cache(maxsize=4096)
def te_band_pieces(sq: int, sk: int, lo: int | None, hi: int | None) -> tuple[BandPiece, ...]:
    """TE calls for a band call ``lo <= j - i <= hi`` of ``sq`` queries and ``sk`` keys
    (``block_plan``'s trimmed band calls: every row and key has a pair, so lo <= 0 <= hi).

    TE takes a window only with ``max_seqlen_q <= max_seqlen_kv`` (its backend table), so a
    call with more rows than keys is cut into runs of rows, each with no more rows than
    the keys they see, and each trimmed to those keys; its band moves with the cut. Rows
    are disjoint (outputs concatenate), keys may overlap (their gradients add). One piece,
    the call itself, when sq <= sk or nothing is masked. ``ValueError`` for a band with
    lo > 0 or hi < 0.
    """
    if (lo is not None and lo > 0) or (hi is not None and hi < 0):
        raise ValueError(f"band ({lo}, {hi}) of a {sq} x {sk} call is not trimmed (lo <= 0 <= hi)")

    def window(a: int, c0: int) -> tuple[int, int]:
        shift = c0 - a  # local j - i of the piece = global j - i - shift
        return (-1 if lo is None else shift - lo, -1 if hi is None else hi - shift)

    if sq <= sk or window(0, 0) == (-1, -1):  # a band with nothing masked: one plain call
        return ((0, sq, 0, sk, *window(0, 0)),)

    def first_key(a: int) -> int:
        return 0 if lo is None else max(0, a + lo)

    def last_key(e: int) -> int:  # the last key row e - 1 sees
        return sk - 1 if hi is None else min(sk - 1, e - 1 + hi)

    out: list[BandPiece] = []
    a = 0
    while a < sq:
        e = a + 1
        while e < sq and e + 1 - a <= last_key(e + 1) - first_key(a) + 1:
            e += 1
        c0, c1 = first_key(a), last_key(e) + 1
        out.append((a, e, c0, c1, *window(a, c0)))
        a = e
    return tuple(out)


def _as_mask(left: int, right: int) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window) of a piece's ``window_size``: TE's own causal call for (-1, 0) and
    the plain one for (-1, -1), as ``DotProductAttention`` passes them; a band otherwise."""
    if (left, right) == (-1, 0):
        return True, None
    if (left, right) == (-1, -1):
        return False, None
    return False, (left, right)


def te_max_tokens(t: int) -> int:
    """Rows of TE 1.13 - 2.10's THD softmax statistics for t tokens (``get_max_tokens`` in
    TE's ``fused_attn_f16_arbitrary_seqlen.cu``): 1024 up to 1024 tokens, then the next
    power of two up to 32K, then the next multiple of 32K."""
    if t <= 1024:
        return 1024
    if t <= 32768:
        return 1 << (t - 1).bit_length()
    return -(-t // 32768) * 32768


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


def detect_te_api(fwd: Any, bwd: Any, version: str = "?") -> TEFusedAttnAPI:
    """Read TE's fused-attention conventions from the parameters of fwd and bwd.

    Raises ``NotImplementedError`` naming the TE version for any parameter the
    adapter does not know, or a missing one it needs.
    """
    fp, freq = _param_names(fwd)
    bp, breq = _param_names(bwd)
    checks = (("fused_attn_fwd", fp, _TE_FWD_KNOWN), ("fused_attn_bwd", bp, _TE_BWD_KNOWN))
    for which, params, known in checks:
        unknown = [n for n in params if n not in known]
        if unknown:
            raise NotImplementedError(
                f"Transformer Engine {version}: {which} has parameters {unknown} this adapter "
                f"does not know (supported: {_TE_SUPPORTED}); parameters: {list(params)}"
            )
    fset, bset = set(fp), set(bp)
    dtype_args = [a for a in ("qkv_dtype", "fake_dtype") if a in fset]
    problems = sorted(_TE_FWD_NEEDED - fset) + sorted(_TE_BWD_NEEDED - bset)
    if len(dtype_args) != 1 or dtype_args[0] not in bset:
        problems.append("exactly one of qkv_dtype / fake_dtype, the same in fwd and bwd")
    if problems:
        raise NotImplementedError(
            f"Transformer Engine {version}: fused_attn_fwd{fp} / fused_attn_bwd{bp} lack "
            f"{problems} (supported: {_TE_SUPPORTED})"
        )
    return TEFusedAttnAPI(fp, bp, freq, breq, dtype_args[0], "dqkv_dtype" in bset, version)


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


@functools.lru_cache(maxsize=64)
def _cached_cu_seqlens(b: int, s: int, device: torch.device) -> Tensor:
    return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)


def _full_cu_seqlens(b: int, s: int, device: torch.device, capturing: bool) -> Tensor:
    """[b + 1] int32 offsets of b unpadded sequences of s tokens (TE's full cu_seqlens);
    cached, except while a CUDA graph is captured (the cached tensor would be unfilled)."""
    if capturing:
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    return _cached_cu_seqlens(b, s, device)


class TEKernel:
    """Transformer Engine's cuDNN fused attention (F16_arbitrary_seqlen) behind the contract.

    Calls ``transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd``
    / ``fused_attn_bwd`` as TE's own context-parallel ring attention does:
    layout ``sbhd_sbhd_sbhd`` (our tensors, made contiguous: TE reads a pointer
    and a shape), full ``cu_seqlens`` (int32 [b + 1]), ``fused_attention_backend
    = FusedAttnBackend["F16_arbitrary_seqlen"]``, softmax statistics from
    ``aux_ctx_tensors[0]`` ([b, h, sq, 1] fp32). The backward passes the final
    merged lse back as those statistics with a zero ``rng_state`` (no dropout).
    GQA natively (k, v keep their heads). Tested only against stand-ins with
    TE's exact signatures; never run on a GPU.

    Args:
        fused_attn: the ``cpp_extensions.fused_attn`` module (imported when ``None``).
        te_dtype: the ``constants.TE_DType`` mapping (imported when needed and ``None``).
        version: TE's version for messages (``transformer_engine.__version__``).
        thd: whether packed documents use the THD format (``None``: detected,
            ``varlen_available``).
        cudnn_version: the cuDNN runtime version for window bands (``None``: read when a
            window is first asked for, from TE's ``get_cudnn_version`` or PyTorch's).

    Sliding windows (``band=(lo, hi)``, ``supports_band``): TE 2.16+ with cuDNN >= 9.6
    (not 9.14.0), as TE's backend table asks for a window (left, right) without a mask; each band call runs as
    ``window_size=(left, right)`` on the top-left diagonal with no mask, cut into pieces
    with no more rows than keys where needed (``te_band_pieces``). Soft-capping: TE has
    none (refused by name).
    """

    name = "te"
    supports_softcap = False  # fused_attn has no logit soft-capping

    def __init__(
        self,
        fused_attn: ModuleType | Any | None = None,
        te_dtype: Mapping[torch.dtype, Any] | None = None,
        version: str | None = None,
        thd: bool | None = None,
        cudnn_version: int | None = None,
    ):
        self._imported = fused_attn is None  # TE itself, not a stand-in
        if fused_attn is None:
            fused_attn = importlib.import_module(
                "transformer_engine.pytorch.cpp_extensions.fused_attn"
            )
            te = importlib.import_module("transformer_engine")
            version = version or str(getattr(te, "__version__", "?"))
        version = version or str(getattr(fused_attn, "__version__", "?"))
        self._fwd = fused_attn.fused_attn_fwd
        self._bwd = fused_attn.fused_attn_bwd
        self.api = detect_te_api(self._fwd, self._bwd, version)
        backends = getattr(fused_attn, "FusedAttnBackend", None)
        if not isinstance(backends, Mapping) or "F16_arbitrary_seqlen" not in backends:
            raise NotImplementedError(
                f"Transformer Engine {version}: cpp_extensions.fused_attn has no "
                f"FusedAttnBackend['F16_arbitrary_seqlen'] (supported: {_TE_SUPPORTED})"
            )
        self._backend = backends["F16_arbitrary_seqlen"]  # what TE's CP code passes for F16
        if te_dtype is None and self.api.needs_te_dtype:
            te_dtype = importlib.import_module("transformer_engine.pytorch.constants").TE_DType
        self._te_dtype = te_dtype
        self._generators: dict[str, torch.Generator] = {}
        self._thd = thd
        # THD softmax statistics: the form TE's forward returns ("padded", "bucketed" or
        # "exact"; fixed by TE release, cuDNN and GPU), so the backward hands back the same.
        self._thd_stats_form: str | None = None
        self._cudnn = cudnn_version

    @property
    def band_unsupported_reason(self) -> str | None:
        """Why this kernel cannot run window bands here, or ``None`` (class docstring)."""
        why = self.api.band_unsupported_reason
        if why is not None:
            return why
        if self._cudnn is None:
            self._cudnn = self._runtime_cudnn()
        if self._cudnn is None or self._cudnn < _TE_BAND_MIN_CUDNN:
            return (
                f"Transformer Engine window bands (left, right) need cuDNN >= "
                f"{_TE_BAND_MIN_CUDNN}, got {self._cudnn}"
            )
        if self._cudnn in _TE_BAND_BAD_CUDNN:
            return (
                f"Transformer Engine takes no window without a causal mask over more than 1024 "
                f"keys on cuDNN {self._cudnn}; use another cuDNN or kernel"
            )
        return None

    def _runtime_cudnn(self) -> int | None:
        """The cuDNN runtime version TE's backend table compares (TE's
        ``cpp_extensions.get_cudnn_version``, e.g. 90600), else PyTorch's; None off CUDA."""
        if not torch.cuda.is_available():
            return None
        if self._imported:
            try:
                ext = importlib.import_module("transformer_engine.pytorch.cpp_extensions")
                return int(ext.get_cudnn_version())
            except (ImportError, AttributeError, RuntimeError, TypeError, ValueError):
                pass
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None

    @property
    def supports_band(self) -> bool:
        """Whether sliding windows run here (``band_unsupported_reason`` is ``None``)."""
        return self.band_unsupported_reason is None

    @property
    def varlen_available(self) -> bool:
        """Whether packed documents go to TE's THD format (else one sbhd call per document).

        ``thd`` given at construction decides; otherwise THD needs what TE's backend
        selection asks of F16_arbitrary_seqlen with ``"thd_thd_thd"`` for every head layout
        and causal window: compute capability >= 9.0 and cuDNN >= 9.6
        (``te_thd_unsupported_reason``), read from the current CUDA device once.
        """
        if self._thd is None:
            cap = cudnn = None
            if torch.cuda.is_available():
                cap = tuple(torch.cuda.get_device_capability())
                if torch.backends.cudnn.is_available():
                    cudnn = torch.backends.cudnn.version()
            self._thd = te_thd_unsupported_reason(cap, cudnn) is None
        return self._thd

    def _dtypes(self, dtype: torch.dtype) -> tuple[Any, Any]:
        """(value of qkv_dtype / fake_dtype, value of dqkv_dtype) for inputs of ``dtype``."""
        te = self._te_dtype[dtype] if self._te_dtype is not None else None
        return (te if self.api.dtype_arg == "qkv_dtype" else dtype), te

    def _generator(self, device: torch.device) -> torch.Generator:
        """A private generator per device: TE draws a Philox state on every forward even
        without dropout, which would otherwise advance the default CUDA generator."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
        return self._generators[key]

    def _stats_to_bhs(self, stats: Tensor, b: int, h: int, sq: int, dtype: torch.dtype) -> Tensor:
        if tuple(stats.shape) != (b, h, sq, 1):
            raise RuntimeError(
                f"Transformer Engine {self.api.version}: softmax statistics of shape "
                f"{tuple(stats.shape)}; expected [{b}, {h}, {sq}, 1]"
            )
        return stats.squeeze(-1).to(acc_dtype(dtype))

    def _band_check(self, band, causal: bool) -> None:
        why = self.band_unsupported_reason
        if why is not None:
            raise NotImplementedError(why)
        if causal:
            raise ValueError("kernel 'te': a band call takes no causal mask (the band has it)")

    def forward(self, q, k, v, *, causal, scale, band=None):
        if band is None:
            return self._forward(q, k, v, causal, scale)
        self._band_check(band, causal)
        _check_te_inputs(q, k, v)
        outs, lses = [], []
        for a, e, c0, c1, left, right in te_band_pieces(q.shape[0], k.shape[0], *band):
            causal, window = _as_mask(left, right)
            o, lse = self._forward(q[a:e], k[c0:c1], v[c0:c1], causal, scale, window)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs), torch.cat(lses, dim=-1)

    def _forward(self, q, k, v, causal, scale, window=None):
        _check_te_inputs(q, k, v)
        sq, b, hq, _ = q.shape
        qc, kc, vc = (x.contiguous() for x in (q, k, v))  # no copy when already sbhd
        capturing = _capturing(q.device)
        cu_q = _full_cu_seqlens(b, sq, q.device, capturing)
        cu_kv = _full_cu_seqlens(b, k.shape[0], q.device, capturing)
        dtype, _ = self._dtypes(q.dtype)
        # A private generator keeps TE's (unused, dropout 0) Philox draw off the default
        # one; under CUDA graph capture only the default generator is registered, so None.
        gen = None if capturing else self._generator(q.device)
        kw = self.api.forward_kwargs(
            qc, kc, vc, cu_q, cu_kv, self._backend, dtype, causal=causal, scale=scale,
            cuda_graph=capturing, rng_gen=gen, window=window,
        )  # fmt: skip
        res = self._fwd(**kw)
        out, aux = res[0], res[1]  # (out, [stats, rng_state, ...]) in every version
        if tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(
                f"Transformer Engine {self.api.version}: output {tuple(out.shape)} != q "
                f"{tuple(q.shape)}"
            )
        return out, self._stats_to_bhs(aux[0], b, hq, sq, q.dtype)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, band=None):
        if band is None:
            return self._backward(dout, q, k, v, out, lse, causal, scale)
        self._band_check(band, causal)
        _check_te_inputs(q, k, v)
        pieces = te_band_pieces(q.shape[0], k.shape[0], *band)
        if len(pieces) == 1:
            causal, window = _as_mask(*pieces[0][4:])
            return self._backward(dout, q, k, v, out, lse, causal, scale, window)
        acc = acc_dtype(q.dtype)
        dqs = []
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for a, e, c0, c1, left, right in pieces:
            causal, window = _as_mask(left, right)
            g_q, g_k, g_v = self._backward(
                dout[a:e], q[a:e], k[c0:c1], v[c0:c1], out[a:e], lse[..., a:e], causal, scale,
                window,
            )  # fmt: skip
            dqs.append(g_q)
            dk[c0:c1] += g_k
            dv[c0:c1] += g_v
        return torch.cat(dqs), dk.to(k.dtype), dv.to(v.dtype)

    def _backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        _check_te_inputs(q, k, v)
        sq, b, hq, _ = q.shape
        if tuple(lse.shape) != (b, hq, sq):
            raise ValueError(f"lse {tuple(lse.shape)} != [{b}, {hq}, {sq}]")
        qc, kc, vc = (x.contiguous() for x in (q, k, v))
        oc, doc = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
        # TE's aux_ctx_tensors: the softmax statistics as the forward returns them
        # ([b, h, sq, 1] fp32), here the final merged lse, then the [seed, offset]
        # rng_state (int64 [2]), which no kernel reads without dropout.
        stats = lse.to(acc_dtype(q.dtype)).unsqueeze(-1).contiguous()
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        capturing = _capturing(q.device)
        cu_q = _full_cu_seqlens(b, sq, q.device, capturing)
        cu_kv = _full_cu_seqlens(b, k.shape[0], q.device, capturing)
        dtype, dqkv_dtype = self._dtypes(q.dtype)
        aux = [stats, rng_state]
        kw = self.api.backward_kwargs(
            doc,
            qc,
            kc,
            vc,
            oc,
            aux,
            cu_q,
            cu_kv,
            self._backend,
            dtype,
            dqkv_dtype,
            causal=causal,
            scale=scale,
            cuda_graph=capturing,
            window=window,
        )
        res = self._bwd(**kw)  # [dq, dk, dv, dbias, (d_softmax_offset)]
        return self._grads(res, q, k, v)

    def _grads(self, res, q, k, v) -> tuple:
        """dq, dk, dv of ``fused_attn_bwd``'s outputs, checked against the inputs' shapes."""
        grads = tuple(res[:3])
        for g, x in zip(grads, (q, k, v)):
            if tuple(g.shape) != tuple(x.shape):
                raise RuntimeError(
                    f"Transformer Engine {self.api.version}: gradient {tuple(g.shape)} for "
                    f"an input of shape {tuple(x.shape)}"
                )
        return grads

    # ---- packed sequences (THD) -------------------------------------------------------
    def _thd_stats_to_packed(self, stats: Tensor, cu_q: Tensor, t: int, h: int, dtype) -> Tensor:
        """TE's THD softmax statistics -> ``[h, t]``. Three forms, by TE release, cuDNN and
        GPU: ``[n_seqs, h, max_seqlen_q, 1]`` (padded per sequence; TE 1.9 - 1.12, cuDNN
        < 9.6, sm120), ``[te_max_tokens(t), h, 1]`` (TE 1.13 - 2.10 round the rows up) and
        ``[t, h, 1]`` (2.11+). The form is kept for the backward; anything else raises."""
        n = cu_q.shape[0] - 1
        if stats.dim() == 4 and tuple(stats.shape[:2]) == (n, h) and stats.shape[3] == 1:
            form, packed = "padded", varlen_lse_packed(stats.squeeze(-1), cu_q, t)
        elif stats.dim() == 3 and tuple(stats.shape[1:]) == (h, 1) and stats.shape[0] >= t:
            rows = stats.shape[0]
            form = "exact" if rows == t else "bucketed"
            if form == "bucketed" and rows != te_max_tokens(t):
                raise RuntimeError(
                    f"Transformer Engine {self.api.version}: THD softmax statistics of "
                    f"{rows} rows for {t} tokens; expected {t} or {te_max_tokens(t)}"
                )
            packed = stats[:t, :, 0].transpose(0, 1)
        else:
            raise RuntimeError(
                f"Transformer Engine {self.api.version}: THD softmax statistics of shape "
                f"{tuple(stats.shape)}; expected [{n}, {h}, max_seqlen_q, 1] or [>= {t}, {h}, 1]"
            )
        if form != self._thd_stats_form and not (form == "exact" and t == te_max_tokens(t)):
            self._thd_stats_form = form  # (t equal to its bucket cannot tell the two apart)
        return packed.to(acc_dtype(dtype))

    def _thd_stats_from_packed(self, lse: Tensor, cu_q: Tensor, max_q: int, dtype) -> Tensor:
        """``[h, t]`` -> the form this kernel's forward returns."""
        h, t = lse.shape
        form = self._thd_stats_form or "exact"
        lse = lse.to(acc_dtype(dtype))
        if form == "padded":
            return varlen_lse_padded(lse, cu_q, max_q).unsqueeze(-1)
        stats = lse.new_zeros(te_max_tokens(t) if form == "bucketed" else t, h, 1)
        stats[:t, :, 0] = lse.transpose(0, 1)
        return stats

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
        _check_te_inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        qc, kc, vc = (x.contiguous() for x in (q, k, v))
        dtype, _ = self._dtypes(q.dtype)
        capturing = _capturing(q.device)
        gen = None if capturing else self._generator(q.device)
        kw = self.api.forward_kwargs(
            qc, kc, vc, cu_q, cu_k, self._backend, dtype, causal=causal, scale=scale,
            cuda_graph=capturing, rng_gen=gen, thd=(int(max_q), int(max_k)),
        )  # fmt: skip
        out, aux = self._fwd(**kw)[:2]
        if tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(
                f"Transformer Engine {self.api.version}: THD output {tuple(out.shape)} != q "
                f"{tuple(q.shape)}"
            )
        return out, self._thd_stats_to_packed(aux[0], cu_q, q.shape[0], q.shape[1], q.dtype)

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, scale):
        _check_te_inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise ValueError(f"lse {tuple(lse.shape)} != [{q.shape[1]}, {q.shape[0]}]")
        qc, kc, vc = (x.contiguous() for x in (q, k, v))
        oc, doc = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
        stats = self._thd_stats_from_packed(lse, cu_q, int(max_q), q.dtype)
        aux = [stats, torch.zeros(2, dtype=torch.int64, device=q.device)]
        dtype, dqkv_dtype = self._dtypes(q.dtype)
        kw = self.api.backward_kwargs(
            doc, qc, kc, vc, oc, aux, cu_q, cu_k, self._backend, dtype, dqkv_dtype,
            causal=causal, scale=scale, cuda_graph=_capturing(q.device),
            thd=(int(max_q), int(max_k)),
        )  # fmt: skip
        return self._grads(self._bwd(**kw), q, k, v)
