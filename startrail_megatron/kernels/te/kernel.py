"""``TEKernel``: Transformer Engine's cuDNN fused attention behind the kernel contract."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..contract import acc_dtype
from ..spec import HALF, BackendSpec
from .api import detect_te_api
from .bands import piece_mask, te_band_pieces
from .limits import (
    TE_SUPPORTED,
    check_te_inputs,
    te_band_cudnn_unsupported_reason,
    te_query_unsupported_reason,
    te_thd_unsupported_reason,
)
from .thd_stats import te_max_tokens, thd_stats_from_packed, thd_stats_to_packed

__all__ = ["TEKernel"]


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (TE's ``cuda_graph``)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
    # no dropout, no logit soft-capping in fused_attn; windows: TE 2.16+ and cuDNN 9.6+,
    # checked by the kernel object (``supports_band``)
    spec = BackendSpec(
        name, frozenset({"cuda"}), HALF, "transformer_engine", 256, 8, (8, 0), 90000,
        dropout=False, window=True, limits=te_query_unsupported_reason,
    )  # fmt: skip
    """What ``"te"`` runs; ``check_te_inputs`` reads its devices and dtypes (only the
    tests widen them, to run stand-ins on CPU)."""
    supports_dropout = spec.dropout
    supports_softcap = spec.softcap

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
                f"FusedAttnBackend['F16_arbitrary_seqlen'] (supported: {TE_SUPPORTED})"
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
        return te_band_cudnn_unsupported_reason(self._cudnn)

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
        return self.spec.window and self.band_unsupported_reason is None

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
        check_te_inputs(q, k, v, self.spec)
        outs, lses = [], []
        for a, e, c0, c1, left, right in te_band_pieces(q.shape[0], k.shape[0], *band):
            causal, window = piece_mask(left, right)
            o, lse = self._forward(q[a:e], k[c0:c1], v[c0:c1], causal, scale, window)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs), torch.cat(lses, dim=-1)

    def _forward(self, q, k, v, causal, scale, window=None):
        check_te_inputs(q, k, v, self.spec)
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
        check_te_inputs(q, k, v, self.spec)
        pieces = te_band_pieces(q.shape[0], k.shape[0], *band)
        if len(pieces) == 1:
            causal, window = piece_mask(*pieces[0][4:])
            return self._backward(dout, q, k, v, out, lse, causal, scale, window)
        acc = acc_dtype(q.dtype)
        dqs = []
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for a, e, c0, c1, left, right in pieces:
            causal, window = piece_mask(left, right)
            g_q, g_k, g_v = self._backward(
                dout[a:e], q[a:e], k[c0:c1], v[c0:c1], out[a:e], lse[..., a:e], causal, scale,
                window,
            )  # fmt: skip
            dqs.append(g_q)
            dk[c0:c1] += g_k
            dv[c0:c1] += g_v
        return torch.cat(dqs), dk.to(k.dtype), dv.to(v.dtype)

    def _backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        check_te_inputs(q, k, v, self.spec)
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
        """TE's THD softmax statistics -> ``[h, t]`` (``thd_stats.thd_stats_to_packed``);
        their form is kept for the backward."""
        packed, form = thd_stats_to_packed(stats, cu_q, t, h, dtype, self.api.version)
        if form != self._thd_stats_form and not (form == "exact" and t == te_max_tokens(t)):
            self._thd_stats_form = form  # (t equal to its bucket cannot tell the two apart)
        return packed

    def _thd_stats_from_packed(self, lse: Tensor, cu_q: Tensor, max_q: int, dtype) -> Tensor:
        """``[h, t]`` -> the form this kernel's forward returns."""
        return thd_stats_from_packed(lse, cu_q, max_q, dtype, self._thd_stats_form or "exact")

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale):
        check_te_inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), self.spec)
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
        check_te_inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), self.spec)
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
