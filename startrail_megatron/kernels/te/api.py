"""TE's ``fused_attn_fwd`` / ``fused_attn_bwd`` as detected from their signatures, and
the keyword arguments this adapter passes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..signatures import param_names
from .limits import TE_SUPPORTED, te_band_release_unsupported_reason

__all__ = ["TEFusedAttnAPI", "detect_te_api"]

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


def _te_fixed_kwargs(
    causal: bool, scale: float, cuda_graph: bool, thd: bool = False, window=None
) -> dict[str, Any]:
    """TE arguments shared by forward and backward: no bias, dropout, sink.

    ``"causal"`` is TE's top-left causal mask (``"causal_bottom_right"`` is the
    other one), the contract's; ``bottom_right_diagonal=False`` is what TE
    derives from it when left ``None``. The window is ``(-1, 0)`` for causal, as
    TE's ``DotProductAttention`` passes it (``check_set_window_size``): TE >= 2.12
    with cuDNN 9.2 - 9.5 finds no backend for a causal mask with ``(-1, -1)``.
    ``cuda_graph``: whether the stream is being captured (``TEKernel`` reads it), passed on as
    TE's own code does (it changes which backward cuDNN may run). ``thd``: packed sequences
    (``"thd_thd_thd"``), whose masks TE names ``"padding_causal"`` / ``"padding"``
    (top-left causal; TE refuses THD with any mask without padding). ``window``: TE's
    ``window_size`` ``(left, right)`` of a band call (``bands.piece_mask``): no mask
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
                f"adapter does not provide (supported: {TE_SUPPORTED})"
            )
        return {n: values[n] for n in params if n in values}

    @property
    def band_unsupported_reason(self) -> str | None:
        """Why this TE release cannot run a window band, or ``None``
        (``limits.te_band_release_unsupported_reason``). cuDNN's part is
        ``TEKernel.band_unsupported_reason``."""
        return te_band_release_unsupported_reason(self.version, self.fwd_params, self.bwd_params)

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


def detect_te_api(fwd: Any, bwd: Any, version: str = "?") -> TEFusedAttnAPI:
    """Read TE's fused-attention conventions from the parameters of fwd and bwd.

    Raises ``NotImplementedError`` naming the TE version for any parameter the
    adapter does not know, or a missing one it needs.
    """
    fp, freq = param_names(fwd)
    bp, breq = param_names(bwd)
    checks = (("fused_attn_fwd", fp, _TE_FWD_KNOWN), ("fused_attn_bwd", bp, _TE_BWD_KNOWN))
    for which, params, known in checks:
        unknown = [n for n in params if n not in known]
        if unknown:
            raise NotImplementedError(
                f"Transformer Engine {version}: {which} has parameters {unknown} this adapter "
                f"does not know (supported: {TE_SUPPORTED}); parameters: {list(params)}"
            )
    fset, bset = set(fp), set(bp)
    dtype_args = [a for a in ("qkv_dtype", "fake_dtype") if a in fset]
    problems = sorted(_TE_FWD_NEEDED - fset) + sorted(_TE_BWD_NEEDED - bset)
    if len(dtype_args) != 1 or dtype_args[0] not in bset:
        problems.append("exactly one of qkv_dtype / fake_dtype, the same in fwd and bwd")
    if problems:
        raise NotImplementedError(
            f"Transformer Engine {version}: fused_attn_fwd{fp} / fused_attn_bwd{bp} lack "
            f"{problems} (supported: {TE_SUPPORTED})"
        )
    return TEFusedAttnAPI(fp, bp, freq, breq, dtype_args[0], "dqkv_dtype" in bset, version)
