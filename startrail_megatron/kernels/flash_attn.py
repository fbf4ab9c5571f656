"""flash-attn 2's private forward/backward behind the kernel contract (``"flash_attn"``).

flash-attn is imported only when ``FlashAttnKernel`` is built. It wants
``[b, s, h, d]`` with a unit last stride (our ``[s, b, h, d]`` transposed is a
view) and returns lse ``[b, h, sq]``.

Its private API changed twice in 2.5 - 2.8, so the adapter reads parameter
names (``signatures._param_names``), never counts outputs:

  2.5.x  fwd(q, k, v, dropout_p, softmax_scale, causal, window_size,
             alibi_slopes, return_softmax)
             -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
  2.6.x  as 2.5 plus ``softcap`` (fwd and bwd)
  2.7+   fwd(..., causal, window_size_left, window_size_right, softcap,
             alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state);
         a ``torch.library.custom_op`` (signature on ``_init_fn``, schema on
         ``torch.ops.flash_attn``) when torch >= 2.4, a plain function otherwise.
  bwd    writes into the dq, dk, dv buffers passed in, in every version.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .contract import lse_to_bhs
from .signatures import _param_names

__all__ = ["FlashAttnAPI", "FlashAttnKernel", "detect_flash_attn_api"]


def _fixed_kwargs(causal: bool, scale: float) -> dict[str, Any]:
    """flash-attn arguments shared by forward and backward: no dropout, window, softcap, alibi."""
    return {
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "causal": causal,
        "window_size": (-1, -1),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
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
        }
    )

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

    def forward_kwargs(self, q, k, v, *, causal: bool, scale: float) -> dict[str, Any]:
        """Keyword arguments of ``_flash_attn_forward`` for [b, s, h, d] inputs."""
        values = {"q": q, "k": k, "v": v, **_fixed_kwargs(causal, scale), "return_softmax": False}
        return self._kwargs(self.fwd_params, self.fwd_required, values, "_flash_attn_forward")

    def backward_kwargs(self, dout, q, k, v, out, lse, dq, dk, dv, *, causal, scale):
        """Keyword arguments of ``_flash_attn_backward``; it fills dq, dk, dv."""
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
            **_fixed_kwargs(causal, scale),
            "deterministic": False,
            "rng_state": None,
        }
        return self._kwargs(self.bwd_params, self.bwd_required, values, "_flash_attn_backward")


def detect_flash_attn_api(fwd: Any, bwd: Any, version: str = "?") -> FlashAttnAPI:
    """Read flash-attn's forward/backward conventions from their parameters."""
    fp, freq = _param_names(fwd)
    bp, breq = _param_names(bwd)
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


class FlashAttnKernel:
    """flash-attn 2's kernels through their private, signature-detected API.

    Args:
        interface: the ``flash_attn.flash_attn_interface`` module (imported
            when ``None``); tests pass stand-ins with each version's signatures.
    """

    name = "flash_attn"

    def __init__(self, interface: ModuleType | Any | None = None):
        if interface is None:
            interface = importlib.import_module("flash_attn.flash_attn_interface")
            version = getattr(importlib.import_module("flash_attn"), "__version__", "?")
        else:
            version = getattr(interface, "__version__", "?")
        self._fwd = interface._flash_attn_forward
        self._bwd = interface._flash_attn_backward
        self.api = detect_flash_attn_api(self._fwd, self._bwd, version)

    def forward(self, q, k, v, *, causal, scale):
        sq, b, hq, _ = q.shape
        qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))  # [b, s, h, d] views
        res = self._fwd(**self.api.forward_kwargs(qb, kb, vb, causal=causal, scale=scale))
        out, lse = res[0], res[self.api.lse_index]
        if tuple(out.shape) != tuple(qb.shape):
            raise RuntimeError(
                f"flash-attn {self.api.version}: output {tuple(out.shape)} != q {tuple(qb.shape)}"
            )
        return out.transpose(0, 1), lse_to_bhs(lse, b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))
        dob, ob = dout.to(q.dtype).transpose(0, 1), out.to(q.dtype).transpose(0, 1)
        dq = torch.empty(qb.shape, dtype=q.dtype, device=q.device)  # [b, sq, hq, d]
        dk = torch.empty(kb.shape, dtype=k.dtype, device=k.device)  # [b, sk, hkv, d]
        dv = torch.empty(vb.shape, dtype=v.dtype, device=v.device)
        kw = self.api.backward_kwargs(
            dob, qb, kb, vb, ob, lse.float().contiguous(), dq, dk, dv, causal=causal, scale=scale
        )
        self._bwd(**kw)
        return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)
