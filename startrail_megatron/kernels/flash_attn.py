"""flash-attn 2's private forward/backward behind the kernel contract (``"flash_attn"``).

flash-attn is imported only when ``FlashAttnKernel`` is built. It wants
``[b, s, h, d]`` with a unit last stride (our ``[s, b, h, d]`` transposed is a
view) and returns lse ``[b, h, sq]``.

Its private API changed twice in 2.5 - 2.8, so the adapter reads parameter
names (``signatures.param_names``), never counts outputs:

  2.5.x  fwd(q, k, v, dropout_p, softmax_scale, causal, window_size,
             alibi_slopes, return_softmax)
             -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
  2.6.x  as 2.5 plus ``softcap`` (fwd and bwd)
  2.7+   fwd(..., causal, window_size_left, window_size_right, softcap,
             alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state);
         a ``torch.library.custom_op`` (signature on ``_init_fn``, schema on
         ``torch.ops.flash_attn``) when torch >= 2.4, a plain function otherwise.
  bwd    writes into the dq, dk, dv buffers passed in, in every version.

The variable-length pair ``_flash_attn_varlen_forward`` / ``_backward`` (packed
documents, THD tensors, int32 ``cu_seqlens``) follows the same changes, plus
``cu_seqlens_q/k`` and ``max_seqlen_q/k`` after v, a required ``block_table``
(2.5.7 - 2.6.0; ``None``), ``leftpad_k``/``seqused_k`` (2.6.1+) and
``zero_tensors`` (2.7.3+). Its ``softmax_lse`` is ``[n_seqs, h, max_seqlen_q]``
(padded per sequence) in 2.5 and ``[h, total_q]`` from 2.6 on; the adapter
detects the form from the tensor, as ring-flash-attention does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .contract import acc_dtype, lse_to_bhs, varlen_lse_packed, varlen_lse_padded
from .signatures import param_names
from .spec import HALF, BackendSpec

__all__ = ["FlashAttnAPI", "FlashAttnKernel", "detect_flash_attn_api"]


def _fixed_kwargs(
    causal: bool, scale: float, dropout_p: float = 0.0, window=(-1, -1), softcap: float = 0.0
) -> dict[str, Any]:
    """flash-attn arguments shared by forward and backward (no alibi)."""
    return {
        "dropout_p": dropout_p,
        "softmax_scale": scale,
        "causal": causal,
        "window_size": tuple(window),
        "window_size_left": window[0],
        "window_size_right": window[1],
        "softcap": softcap,
        "alibi_slopes": None,
        "block_table": None,  # varlen only: no paged KV cache
        "leftpad_k": None,
        "seqused_k": None,
        "zero_tensors": False,
    }


@dataclass(frozen=True)
class FlashAttnAPI:
    """flash-attn's private forward/backward as detected from their signatures.

    Attributes:
        fwd_params, bwd_params: parameter names, in order.
        split_window: ``window_size_left``/``_right`` (2.7+) instead of ``window_size``.
        lse_index: where ``softmax_lse`` sits in the forward's outputs: 1 for the
            2.7+ ``(out, softmax_lse, S_dmask, rng_state)``, 5 for the 2.5/2.6
            ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``.
        version: the package's ``__version__`` (messages only).
    """

    fwd_params: tuple[str, ...]
    bwd_params: tuple[str, ...]
    fwd_required: frozenset[str]
    bwd_required: frozenset[str]
    split_window: bool
    lse_index: int
    version: str = "?"

    _KNOWN = frozenset(
        {
            "q",
            "k",
            "v",
            "dout",
            "out",
            "softmax_lse",
            "dq",
            "dk",
            "dv",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "return_softmax",
            "deterministic",
            "rng_state",
            "cu_seqlens_q",
            "cu_seqlens_k",
            "max_seqlen_q",
            "max_seqlen_k",
            "block_table",
            "leftpad_k",
            "seqused_k",
            "zero_tensors",
        }
    )

    @property
    def padded_varlen_lse(self) -> bool:
        """2.5's varlen softmax_lse is ``[n_seqs, h, max_seqlen_q]`` (``[h, total_q]`` from
        2.6, the release that added ``softcap``)."""
        return not self.split_window and "softcap" not in self.fwd_params

    def _kwargs(self, params, required, values: dict[str, Any], which: str) -> dict[str, Any]:
        unknown = sorted(n for n in required if n not in self._KNOWN)
        if unknown:
            raise NotImplementedError(
                f"flash-attn {self.version}: {which} has parameters {unknown} this adapter does "
                f"not know (supported: flash-attn 2.5 - 2.8); parameters: {list(params)}"
            )
        out = {n: values[n] for n in params if n in values}
        if self.split_window:
            out.pop("window_size", None)
        return out

    @property
    def rng_index(self) -> int:
        """Where ``rng_state`` sits in the forward's outputs (3 from 2.7, else 7)."""
        return 3 if self.split_window else 7

    def forward_kwargs(
        self, q, k, v, *, causal: bool, scale: float, varlen=None, dropout_p=0.0,
        window=(-1, -1), softcap=0.0,
    ):  # fmt: skip
        """Keyword arguments of ``_flash_attn_forward`` for [b, s, h, d] inputs, or of
        ``_flash_attn_varlen_forward`` for THD inputs when ``varlen`` is
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``."""
        values = {
            "q": q,
            "k": k,
            "v": v,
            **_fixed_kwargs(causal, scale, dropout_p, window, softcap),
        }
        values["return_softmax"] = False
        values.update(_varlen_values(varlen))
        which = "_flash_attn_varlen_forward" if varlen else "_flash_attn_forward"
        return self._kwargs(self.fwd_params, self.fwd_required, values, which)

    def backward_kwargs(
        self, dout, q, k, v, out, lse, dq, dk, dv, *, causal, scale, varlen=None, dropout=None,
        window=(-1, -1), softcap=0.0,
    ):  # fmt: skip
        """Keyword arguments of ``_flash_attn_backward`` (or ``_flash_attn_varlen_backward``
        with ``varlen`` as in ``forward_kwargs``); it fills dq, dk, dv."""
        values = {
            "dout": dout,
            "q": q,
            "k": k,
            "v": v,
            "out": out,
            "softmax_lse": lse,
            "dq": dq,
            "dk": dk,
            "dv": dv,
            **_fixed_kwargs(causal, scale, 0.0 if dropout is None else dropout.p, window, softcap),
            "deterministic": False,
            "rng_state": None if dropout is None else dropout.state,
            **_varlen_values(varlen),
        }
        which = "_flash_attn_varlen_backward" if varlen else "_flash_attn_backward"
        return self._kwargs(self.bwd_params, self.bwd_required, values, which)


def _window(sq: int, sk: int, band) -> tuple[int, int]:
    """flash-attn's ``window_size`` for the band ``lo <= j - i <= hi`` of an sq x sk call.

    flash-attn aligns its window to the bottom-right corner: query i sees keys
    ``i + sk - sq - left .. i + sk - sq + right`` (-1: unbounded). ``schedule.windows`` trims
    band calls so every row and key has a pair, which makes both sizes >= 0.
    """
    lo, hi = band
    left = -1 if lo is None else (sk - sq) - lo
    right = -1 if hi is None else hi - (sk - sq)
    if left < -1 or right < -1 or (lo is not None and left < 0) or (hi is not None and right < 0):
        raise ValueError(f"band {band} of a {sq} x {sk} call is not a flash-attn window")
    return left, right


def _p(dropout) -> dict[str, Any]:
    """``dropout_p`` of a ``contract.Dropout`` record (flash-attn draws its Philox state
    from the current CUDA generator: Megatron's RNG tracker ``fork`` swaps it)."""
    if dropout is None:
        return {}
    if dropout.generator is not None:
        raise NotImplementedError(
            "kernel 'flash_attn' draws dropout from the CUDA default generator; it takes no "
            "generator of its own"
        )
    return {"dropout_p": dropout.p}


def _keep_rng(dropout, res, api: FlashAttnAPI) -> None:
    """Keep the forward's ``rng_state`` (seed, offset) for the backward's mask."""
    if dropout is not None:
        dropout.state = res[api.rng_index]


def _varlen_values(varlen) -> dict[str, Any]:
    if varlen is None:
        return {}
    cu_q, cu_k, max_q, max_k = varlen
    return {
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": max_q,
        "max_seqlen_k": max_k,
    }


def detect_flash_attn_api(fwd: Any, bwd: Any, version: str = "?") -> FlashAttnAPI:
    """Read flash-attn's forward/backward conventions from their parameters."""
    fp, freq = param_names(fwd)
    bp, breq = param_names(bwd)
    fset, bset = set(fp), set(bp)
    if {"window_size_left", "window_size_right"} <= fset:
        split, lse_index = True, 1
    elif "window_size" in fset:
        split, lse_index = False, 5
    else:
        raise NotImplementedError(
            f"flash-attn {version}: _flash_attn_forward{fp} has neither window_size nor "
            "window_size_left/right; supported: flash-attn 2.5 - 2.8"
        )
    need_b = {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "causal"}
    if not {"q", "k", "v", "causal", "softmax_scale"} <= fset or not need_b <= bset:
        raise NotImplementedError(
            f"flash-attn {version}: unexpected signatures _flash_attn_forward{fp}, "
            f"_flash_attn_backward{bp}; supported: flash-attn 2.5 - 2.8"
        )
    if split != ({"window_size_left", "window_size_right"} <= bset):
        raise NotImplementedError(
            f"flash-attn {version}: forward and backward disagree on the window arguments"
        )
    return FlashAttnAPI(fp, bp, freq, breq, split, lse_index, version)


def _empty_rows_minus_inf(lse):
    """flash-attn gives a row that sees no key lse = +inf (its backward then makes its
    probabilities 0); the kernel contract's is -inf, which ``merge_partial`` weighs 0
    (+inf would take the whole merged row, NaN from inf - inf). Only the forward's copy is
    changed: the backward gets the merged lse."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


class FlashAttnKernel:
    """flash-attn 2's kernels through their private, signature-detected API.

    Args:
        interface: the ``flash_attn.flash_attn_interface`` module (imported
            when ``None``); tests pass stand-ins with each version's signatures.
    """

    name = "flash_attn"
    # dropout: its own Philox, rng_state kept per call; sliding windows through
    # window_size (``_window``); softcap: 2.6+, ``supports_softcap`` of the instance
    spec = BackendSpec(
        name, frozenset({"cuda"}), HALF, "flash_attn", 256, 8, (8, 0), window=True, softcap=True
    )
    supports_dropout = spec.dropout
    supports_band = spec.window
    softcap_with_dropout = False  # flash-attn: "Softcapping does not support dropout for now"

    def __init__(self, interface: ModuleType | Any | None = None):
        if interface is None:
            interface = importlib.import_module("flash_attn.flash_attn_interface")
            version = getattr(importlib.import_module("flash_attn"), "__version__", "?")
        else:
            version = getattr(interface, "__version__", "?")
        self._fwd = interface._flash_attn_forward
        self._bwd = interface._flash_attn_backward
        self.api = detect_flash_attn_api(self._fwd, self._bwd, version)
        # soft-capping arrived in 2.6 (``softcap``, forward and backward)
        self.supports_softcap = self.spec.softcap and "softcap" in self.api.fwd_params
        self._vfwd = getattr(interface, "_flash_attn_varlen_forward", None)
        self._vbwd = getattr(interface, "_flash_attn_varlen_backward", None)
        self.varlen_api = None
        self.varlen_unavailable_reason = "flash-attn has no _flash_attn_varlen_forward/backward"
        if self._vfwd is not None and self._vbwd is not None:
            try:
                self.varlen_api = detect_flash_attn_api(self._vfwd, self._vbwd, version)
            except NotImplementedError as e:  # the dense functions still work
                self.varlen_unavailable_reason = f"varlen functions: {e}"

    @property
    def varlen_available(self) -> bool:
        """Whether the installed flash-attn has variable-length functions this adapter
        reads (else packed documents run one dense call per document and block)."""
        return self.varlen_api is not None

    def _extras(self, sq: int, sk: int, band, softcap) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if band is not None:
            out["window"] = _window(sq, sk, band)
        if softcap:
            if not self.supports_softcap:
                raise NotImplementedError(
                    f"flash-attn {self.api.version} has no softcap (2.6+ does)"
                )
            out["softcap"] = float(softcap)
        return out

    def forward(self, q, k, v, *, causal, scale, dropout=None, band=None, softcap=0.0):
        sq, b, hq, _ = q.shape
        qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))  # [b, s, h, d] views
        kw = self.api.forward_kwargs(
            qb, kb, vb, causal=causal, scale=scale, **_p(dropout),
            **self._extras(sq, k.shape[0], band, softcap),
        )  # fmt: skip
        res = self._fwd(**kw)
        out, lse = res[0], _empty_rows_minus_inf(res[self.api.lse_index])
        _keep_rng(dropout, res, self.api)
        if tuple(out.shape) != tuple(qb.shape):
            raise RuntimeError(
                f"flash-attn {self.api.version}: output {tuple(out.shape)} != q {tuple(qb.shape)}"
            )
        return out.transpose(0, 1), lse_to_bhs(lse, b, hq, sq)

    def backward(
        self, dout, q, k, v, out, lse, *, causal, scale, dropout=None, band=None, softcap=0.0
    ):
        qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))
        dob, ob = dout.to(q.dtype).transpose(0, 1), out.to(q.dtype).transpose(0, 1)
        dq = torch.empty(qb.shape, dtype=q.dtype, device=q.device)  # [b, sq, hq, d]
        dk = torch.empty(kb.shape, dtype=k.dtype, device=k.device)  # [b, sk, hkv, d]
        dv = torch.empty(vb.shape, dtype=v.dtype, device=v.device)
        kw = self.api.backward_kwargs(
            dob, qb, kb, vb, ob, lse.float().contiguous(), dq, dk, dv, causal=causal, scale=scale,
            dropout=dropout, **self._extras(q.shape[0], k.shape[0], band, softcap),
        )  # fmt: skip
        self._bwd(**kw)
        return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)

    def _varlen_cap(self, softcap) -> dict[str, Any]:
        if not softcap:
            return {}
        if "softcap" not in self.varlen_api.fwd_params:
            raise NotImplementedError(f"flash-attn {self.api.version} has no softcap (2.6+ does)")
        return {"softcap": float(softcap)}

    def forward_varlen(
        self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, dropout=None, softcap=0.0
    ):
        api = self.varlen_api
        kw = api.forward_kwargs(
            q, k, v, causal=causal, scale=scale, varlen=(cu_q, cu_k, int(max_q), int(max_k)),
            **_p(dropout), **self._varlen_cap(softcap),
        )  # fmt: skip
        res = self._vfwd(**kw)
        out, lse = res[0], _empty_rows_minus_inf(res[api.lse_index])
        _keep_rng(dropout, res, api)
        if tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(
                f"flash-attn {api.version}: output {tuple(out.shape)} != q {tuple(q.shape)}"
            )
        return out, self._lse_packed(lse, cu_q, q.shape[0], q.shape[1]).to(acc_dtype(q.dtype))

    def _lse_packed(self, lse, cu_q, t: int, h: int):
        """The varlen lse as ``[h, t]``: 2.6+ returns it so, 2.5 as ``[n, h, max_q]``."""
        if lse.dim() == 2 and tuple(lse.shape) == (h, t):
            return lse
        if lse.dim() == 3 and lse.shape[0] == cu_q.shape[0] - 1 and lse.shape[1] == h:
            return varlen_lse_packed(lse, cu_q, t)
        raise RuntimeError(
            f"flash-attn {self.varlen_api.version}: varlen log-sum-exp of shape "
            f"{tuple(lse.shape)}; expected [{h}, {t}] or [{cu_q.shape[0] - 1}, {h}, max_seqlen_q]"
        )

    def backward_varlen(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, scale, dropout=None,
        softcap=0.0,
    ):  # fmt: skip
        api = self.varlen_api
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        lse = lse.to(acc_dtype(q.dtype)).contiguous()  # fp32 for fp16/bf16 inputs
        if api.padded_varlen_lse:  # 2.5: [n, h, max_q]
            lse = varlen_lse_padded(lse, cu_q, int(max_q))
        kw = api.backward_kwargs(
            dout.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse,
            dq, dk, dv, causal=causal, scale=scale,
            varlen=(cu_q, cu_k, int(max_q), int(max_k)), dropout=dropout,
            **self._varlen_cap(softcap),
        )  # fmt: skip
        self._vbwd(**kw)
        return dq, dk, dv
