"""GPU backends on CPU: selection, flash-attn / TE signature adaptation, SDPA op wiring.

The CUDA kernels cannot run here. What can be checked is checked:
- selection is pure and tested over a table of (device, dtype, head_dim,
  capability, installed) cases, with the override setting;
- the flash-attn adapter runs against stand-ins whose signatures and return
  conventions are those of flash-attn 2.5, 2.6 and 2.7/2.8 (as a plain function
  and as the ``torch.library.custom_op`` that 2.7+ registers), computing real
  attention in flash-attn's [b, s, h, d] layout, so layouts, lse positions and
  in-place gradients are verified numerically against the reference kernel;
- the PyTorch CUDA SDPA ops are called through their meta kernels, which check
  the argument schema and give the real output shapes (efficient attention's
  padded lse, cuDNN's [b, h, s, 1] lse, flash's GQA gradients);
- the Transformer Engine adapter runs against stand-in ``transformer_engine``
  modules (put in ``sys.modules``) whose ``fused_attn_fwd`` / ``fused_attn_bwd``
  have the exact signatures of TE 1.11 - 1.13, 2.2 - 2.7 and 2.15 - 2.18 and
  compute real attention in float64 from the layout, mask and statistics they
  are given, recording every argument.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types

import pytest
import torch

import startrail_megatron as st
from startrail_megatron import kernels as kn
from startrail_megatron.kernels import TorchKernel
from startrail_megatron.kernels import choice as kn_choice
from startrail_megatron.kernels import sdpa as kn_sdpa
from startrail_megatron.kernels import signatures as kn_signatures
from startrail_megatron.kernels import te as kn_te
from startrail_megatron.kernels.te import kernel as kn_te_kernel

CUDA_H100 = dict(device_type="cuda", capability=(9, 0), cudnn_version=90100)


def _all(_: str) -> bool:
    return True


def _none(_: str) -> bool:
    return False


@pytest.mark.parametrize(
    "query,installed,want",
    [
        (
            kn.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100),
            _all,
            ["flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch"],
        ),
        (
            kn.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100),
            _none,
            ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch"],
        ),
        (
            kn.KernelQuery(dtype=torch.float16, head_dim=192, **CUDA_H100),
            _all,
            ["flash_attn", "sdpa_flash", "sdpa_efficient", "torch"],
        ),  # cuDNN: head_dim <= 128
        (
            kn.KernelQuery(dtype=torch.float32, head_dim=128, **CUDA_H100),
            _all,
            ["sdpa_efficient", "torch"],
        ),
        (kn.KernelQuery(dtype=torch.float16, head_dim=100, **CUDA_H100), _all, ["torch"]),
        (
            kn.KernelQuery("cuda", torch.float16, 128, (7, 5), 90100),
            _all,
            ["sdpa_efficient", "torch"],
        ),  # Turing: no flash, no cuDNN SDPA
        (
            kn.KernelQuery("cuda", torch.bfloat16, 128, (8, 0), 8900),
            _all,
            ["flash_attn", "sdpa_flash", "sdpa_efficient", "torch"],
        ),  # cuDNN 8
        (kn.KernelQuery(dtype=torch.float64, head_dim=64, **CUDA_H100), _all, ["torch"]),
        (kn.KernelQuery("cpu", torch.bfloat16, 64), _all, ["sdpa", "torch"]),
        (kn.KernelQuery("cpu", torch.float64, 64), _all, ["torch"]),
        (kn.KernelQuery("mps", torch.float32, 64), _all, ["torch"]),
    ],
)
def test_auto_selection(query, installed, want):
    assert kn.choose_kernel("auto", query, installed, env={}) == want


def test_explicit_names_and_override():
    h100 = kn.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100)
    assert kn.choose_kernel("sdpa_cudnn", h100, _all, env={}) == ["sdpa_cudnn"]
    # the environment variable replaces "auto" only
    env = {kn.KERNEL_ENV: "sdpa_efficient"}
    assert kn.choose_kernel("auto", h100, _all, env=env) == ["sdpa_efficient"]
    assert kn.choose_kernel("sdpa_flash", h100, _all, env=env) == ["sdpa_flash"]
    with pytest.raises(NotImplementedError, match=r"kernel='flash_attn' cannot run.*not installed"):
        kn.choose_kernel("flash_attn", h100, _none, env={})
    cpu = kn.KernelQuery("cpu", torch.bfloat16, 64)
    with pytest.raises(NotImplementedError, match=r"STARTRAIL_KERNEL='sdpa_flash' cannot run"):
        kn.choose_kernel("auto", cpu, _all, env={kn.KERNEL_ENV: "sdpa_flash"})
    with pytest.raises(NotImplementedError, match=r"takes \['bfloat16', 'float16'\], not float32"):
        kn.choose_kernel("flash_attn", kn.KernelQuery(dtype=torch.float32, **CUDA_H100), _all, {})
    allowed = (
        r"allowed: \['auto', 'torch', 'sdpa', 'flash_attn', 'sdpa_flash', 'sdpa_cudnn', "
        r"'sdpa_efficient', 'te'\]"
    )
    with pytest.raises(ValueError, match=r"STARTRAIL_KERNEL='flash2' is not known; " + allowed):
        kn.choose_kernel("auto", cpu, _all, env={kn.KERNEL_ENV: "flash2"})
    with pytest.raises(ValueError, match=r"kernel='fa' is not known; " + allowed):
        st.get_kernel("fa")
    # "te" is an explicit choice only (test_auto_selection: never in "auto")
    assert kn.choose_kernel("te", h100, _all, env={}) == ["te"]
    assert kn.choose_kernel("auto", h100, _all, env={kn.KERNEL_ENV: "te"}) == ["te"]


def test_get_kernel_reads_the_environment(monkeypatch):
    monkeypatch.setenv(kn.KERNEL_ENV, "torch")
    assert st.get_kernel("auto", torch.float32).name == "torch"
    assert st.get_kernel("sdpa", torch.float32).name == "sdpa"
    monkeypatch.delenv(kn.KERNEL_ENV)
    assert st.get_kernel("auto", torch.float32).name == "sdpa"


def test_auto_skips_a_backend_whose_import_fails(monkeypatch):
    def broken():
        raise ImportError("flash_attn_2_cuda: undefined symbol")

    monkeypatch.setitem(kn_choice._CONSTRUCTORS, "flash_attn", broken)
    h100 = kn.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100)
    ker = kn.build_kernel("auto", query=h100, installed=_all, env={})
    assert ker.name == "sdpa_flash"
    with pytest.raises(ImportError, match="undefined symbol"):
        kn.build_kernel("flash_attn", query=h100, installed=_all, env={})


def test_lse_forms():
    lse = torch.randn(2, 3, 40)
    assert torch.equal(kn.lse_to_bhs(lse, 2, 3, 40), lse)
    padded = torch.nn.functional.pad(lse, (0, 24))
    assert torch.equal(kn.lse_to_bhs(padded, 2, 3, 40), lse)
    assert torch.equal(kn.lse_to_bhs(lse.unsqueeze(-1), 2, 3, 40), lse)
    padded_inf = kn_sdpa._pad_rows(lse, 32)
    assert padded_inf.shape == (2, 3, 64) and padded_inf.is_contiguous()
    assert torch.equal(padded_inf[..., :40], lse) and torch.isposinf(padded_inf[..., 40:]).all()
    with pytest.raises(RuntimeError, match=r"expected \[2, 3, >= 41\]"):
        kn.lse_to_bhs(lse, 2, 3, 41)


# ---- flash-attn stand-ins, one per upstream signature --------------------------------------


def _flash_mask(sq, sk, causal, window, softcap) -> dict:
    """flash-attn's mask as the reference kernel's arguments: the window (and the causal
    mask) aligned to the bottom-right corner, -1 unbounded; soft-capping."""
    left, right = window
    assert isinstance(left, int) and isinstance(right, int) and left >= -1 and right >= -1
    kw = {"softcap": softcap} if softcap else {}
    if (left, right) == (-1, -1):
        return {"causal": causal, **kw}
    off = sk - sq
    lo = None if left == -1 else off - left
    hi = None if right == -1 else off + right
    if causal:
        hi = off if hi is None else min(hi, off)
    return {"causal": False, "band": (lo, hi), **kw}


def _ref_fwd(q, k, v, causal, scale, dropout_p=0.0, window=(-1, -1), softcap=0.0):
    """Real attention for [b, s, h, d] inputs, checked like flash-attn's mha_fwd; with
    dropout drawn, as flash-attn from its device's generator, from the default generator:
    -> (out, lse, rng_state), the rng_state the generator's state (flash: seed, offset)."""
    for x in (q, k, v):
        assert x.stride(-1) == 1, "flash-attn needs a unit last stride"
    drop = kn.Dropout(dropout_p) if dropout_p else None
    mask = _flash_mask(q.shape[1], k.shape[1], causal, window, softcap)
    out, lse = TorchKernel().forward(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale, **mask,
        **({"dropout": drop} if drop else {}),
    )  # fmt: skip
    rng = drop.state if drop else torch.zeros(2, dtype=torch.int64)
    return (
        out.transpose(0, 1).contiguous(),
        lse.float() if q.dtype != torch.float64 else lse,
        rng,
    )


def _ref_bwd(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, dropout_p=0.0, rng_state=None,
             window=(-1, -1), softcap=0.0):  # fmt: skip
    for x in (dout, q, k, v, out, dq, dk, dv):
        assert x.stride(-1) == 1
    assert lse.is_contiguous() and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    kw = {"dropout": kn.Dropout(dropout_p, state=rng_state)} if dropout_p else {}
    kw.update(_flash_mask(q.shape[1], k.shape[1], causal, window, softcap))
    g = TorchKernel().backward(
        *(x.transpose(0, 1) for x in (dout, q, k, v, out)), lse, scale=scale, **kw
    )
    for buf, val in zip((dq, dk, dv), g):
        buf.copy_(val.transpose(0, 1))
    return torch.zeros_like(lse)  # softmax_d


def _ref_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap=0.0):
    """Real attention per sequence of THD inputs, checked like flash-attn's mha_varlen_fwd:
    -> out [t, h, d], lse [h, t] (float32; float64 for float64 inputs)."""
    for x in (q, k, v):
        assert x.dim() == 3 and x.stride(-1) == 1, "flash-attn needs THD with a unit last stride"
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    lens_k = [b - a for a, b in zip(ck, ck[1:])]
    assert max_q == max(lens_q) and max_k == max(lens_k) and min(lens_q + lens_k) > 0
    outs, lses = [], []
    for i in range(len(cq) - 1):
        if causal:  # flash-attn aligns the causal mask bottom-right; equal lengths: no matter
            assert lens_q[i] == lens_k[i]
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        o, lse = TorchKernel().forward(
            q[qs].unsqueeze(1), k[ks].unsqueeze(1), v[ks].unsqueeze(1), causal=causal, scale=scale,
            **({"softcap": softcap} if softcap else {}),
        )  # fmt: skip
        outs.append(o[:, 0])
        lses.append(lse[0])
    lse = torch.cat(lses, dim=1)
    return torch.cat(outs), lse.float() if q.dtype != torch.float64 else lse


def _ref_varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, causal, scale, softcap=0.0):
    """Fills dq, dk, dv (THD, written in place as flash-attn does) from lse [h, t]."""
    for x in (dout, q, k, v, out, dq, dk, dv):
        assert x.dim() == 3 and x.stride(-1) == 1
    assert lse.is_contiguous() and lse.shape == (q.shape[1], q.shape[0])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        g = TorchKernel().backward(
            *(x[sl].unsqueeze(1) for x, sl in ((dout, qs), (q, qs), (k, ks), (v, ks), (out, qs))),
            lse[:, qs].unsqueeze(0),
            causal=causal,
            scale=scale,
            **({"softcap": softcap} if softcap else {}),
        )
        for buf, sl, val in zip((dq, dk, dv), (qs, ks, ks), g):
            buf[sl] = val[:, 0]
    return torch.zeros_like(lse)  # softmax_d


def _v25():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size,
                            alibi_slopes, return_softmax):  # fmt: skip
        assert alibi_slopes is None and return_softmax is False
        out, lse, rng = _ref_fwd(q, k, v, causal, softmax_scale, dropout_p, window_size)
        return out, q, k, v, out, lse, None, rng

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                             softmax_scale, causal, window_size, alibi_slopes, deterministic,
                             rng_state=None):  # fmt: skip
        d = _ref_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale,
                     dropout_p, rng_state, window_size)  # fmt: skip
        return dq, dk, dv, d

    # 2.5.7 - 2.5.9: block_table required; softmax_lse [n_seqs, h, max_seqlen_q]
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                   alibi_slopes, return_softmax, block_table):  # fmt: skip
        assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and block_table is None
        out, lse = _ref_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal, softmax_scale)  # fmt: skip
        lse = kn.contract.varlen_lse_padded(lse, cu_seqlens_q, max_seqlen_q)
        return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, window_size, alibi_slopes,
                                    deterministic, rng_state=None):  # fmt: skip
        n = cu_seqlens_q.shape[0] - 1
        assert softmax_lse.shape == (n, q.shape[1], max_seqlen_q)
        lse = kn.contract.varlen_lse_packed(softmax_lse, cu_seqlens_q, q.shape[0]).contiguous()
        d = _ref_varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                            causal, softmax_scale)  # fmt: skip
        return dq, dk, dv, d

    return types.SimpleNamespace(
        __version__="2.5.9",
        _flash_attn_forward=_flash_attn_forward,
        _flash_attn_backward=_flash_attn_backward,
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_flash_attn_varlen_backward,
    )


def _v26():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, return_softmax):  # fmt: skip
        out, lse, rng = _ref_fwd(q, k, v, causal, softmax_scale, dropout_p, window_size, softcap)
        return out, q, k, v, out, lse, None, rng

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes,
                             deterministic, rng_state=None):  # fmt: skip
        d = _ref_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale,
                     dropout_p, rng_state, window_size, softcap)  # fmt: skip
        return dq, dk, dv, d

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal,
                                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                   return_softmax=False, block_table=None, leftpad_k=None,
                                   seqused_k=None):  # fmt: skip
        assert tuple(window_size) == (-1, -1) and block_table is None
        assert leftpad_k is None and seqused_k is None and return_softmax is False
        out, lse = _ref_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal, softmax_scale, softcap)  # fmt: skip
        return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, rng_state=None):  # fmt: skip
        assert dropout_p == 0.0
        d = _ref_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                            cu_seqlens_k, causal, softmax_scale, softcap)  # fmt: skip
        return dq, dk, dv, d

    return types.SimpleNamespace(
        __version__="2.6.3",
        _flash_attn_forward=_flash_attn_forward,
        _flash_attn_backward=_flash_attn_backward,
        _flash_attn_varlen_forward=_flash_attn_varlen_forward,
        _flash_attn_varlen_backward=_flash_attn_varlen_backward,
    )


def _fwd27(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
           softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
           softcap: float, alibi_slopes: torch.Tensor | None, return_softmax: bool,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    window = (window_size_left, window_size_right)
    out, lse, rng = _ref_fwd(q, k, v, causal, softmax_scale, dropout_p, window, softcap)
    return out, lse, torch.empty(0, dtype=q.dtype), rng


def _bwd27(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
           dk: torch.Tensor | None, dv: torch.Tensor | None, dropout_p: float,
           softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
           softcap: float, alibi_slopes: torch.Tensor | None, deterministic: bool,
           rng_state: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    return _ref_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale,
                    dropout_p, rng_state, (window_size_left, window_size_right),
                    softcap)  # fmt: skip


def _vfwd27(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
            softmax_scale: float, causal: bool, window_size_left: int = -1,
            window_size_right: int = -1, softcap: float = 0.0,
            alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
            block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
            seqused_k: torch.Tensor | None = None, zero_tensors: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    assert (window_size_left, window_size_right) == (-1, -1)
    assert block_table is None and leftpad_k is None and seqused_k is None and not zero_tensors
    out, lse = _ref_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, softmax_scale, softcap)  # fmt: skip
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _vbwd27(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
            dk: torch.Tensor | None, dv: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
            softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
            softcap: float, alibi_slopes: torch.Tensor | None, deterministic: bool,
            rng_state: torch.Tensor | None = None,
            zero_tensors: bool = False) -> torch.Tensor:  # fmt: skip
    return _ref_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                           cu_seqlens_k, causal, softmax_scale, softcap)  # fmt: skip


def _v27_plain():  # flash-attn 2.7+ under torch < 2.4: plain functions
    return types.SimpleNamespace(
        __version__="2.7.4",
        _flash_attn_forward=_fwd27,
        _flash_attn_backward=_bwd27,
        _flash_attn_varlen_forward=_vfwd27,
        _flash_attn_varlen_backward=_vbwd27,
    )


_CUSTOM: dict = {}


def _v27_custom_op():  # flash-attn 2.7 / 2.8 under torch >= 2.4: torch.library custom ops
    if not _CUSTOM:
        fwd = torch.library.custom_op(
            "startrail_test::flash_fwd", _fwd27, mutates_args=(), device_types="cpu"
        )
        bwd = torch.library.custom_op(
            "startrail_test::flash_bwd", _bwd27, mutates_args=("dq", "dk", "dv"), device_types="cpu"
        )
        vfwd = torch.library.custom_op(
            "startrail_test::flash_varlen_fwd", _vfwd27, mutates_args=(), device_types="cpu"
        )
        vbwd = torch.library.custom_op(
            "startrail_test::flash_varlen_bwd",
            _vbwd27,
            mutates_args=("dq", "dk", "dv"),
            device_types="cpu",
        )
        _CUSTOM.update(
            __version__="2.8.3",
            _flash_attn_forward=fwd,
            _flash_attn_backward=bwd,
            _flash_attn_varlen_forward=vfwd,
            _flash_attn_varlen_backward=vbwd,
        )
    return types.SimpleNamespace(**_CUSTOM)


FLASH_VERSIONS = {
    "2.5": _v25,
    "2.6": _v26,
    "2.7-plain": _v27_plain,
    "2.8-custom-op": _v27_custom_op,
}


@pytest.mark.parametrize("version", list(FLASH_VERSIONS))
def test_flash_attn_api_detection(version):
    api = kn.FlashAttnKernel(FLASH_VERSIONS[version]()).api
    assert api.split_window == (version not in ("2.5", "2.6"))
    assert api.lse_index == (1 if api.split_window else 5)
    assert ("softcap" in api.fwd_params) == (version != "2.5")


def test_custom_op_parameters_come_from_its_function_or_schema():
    ns = _v27_custom_op()
    op = ns._flash_attn_forward
    assert type(op).__name__ == "CustomOpDef"  # what flash-attn 2.7+ exposes
    names, required = kn_signatures.param_names(op)
    assert names[6:8] == ("window_size_left", "window_size_right")
    schema_names, _ = kn_signatures.param_names(torch.ops.startrail_test.flash_fwd)
    assert schema_names == names
    bwd_names, bwd_required = kn_signatures.param_names(torch.ops.startrail_test.flash_bwd.default)
    assert "rng_state" in bwd_names and "rng_state" not in bwd_required


@pytest.mark.parametrize("version", list(FLASH_VERSIONS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_flash_attn_adapter_computes_attention(version, causal, hq, hkv):
    ker = kn.FlashAttnKernel(FLASH_VERSIONS[version]())
    g = torch.Generator().manual_seed(1)
    sq, sk = 6, 6 if causal else 5
    q = torch.randn(sq, 2, hq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(sk, 2, hkv, 16, generator=g, dtype=torch.float64)
    v = torch.randn(sk, 2, hkv, 16, generator=g, dtype=torch.float64)
    do = torch.randn(sq, 2, hq, 16, generator=g, dtype=torch.float64)
    ref = TorchKernel()
    out, lse = ker.forward(q, k, v, causal=causal, scale=0.3)
    r_out, r_lse = ref.forward(q, k, v, causal=causal, scale=0.3)
    assert out.shape == q.shape and lse.shape == (2, hq, sq) and lse.dtype == torch.float32
    torch.testing.assert_close(out, r_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse.double(), r_lse, rtol=0, atol=1e-6)
    grads = ker.backward(do, q, k, v, r_out, r_lse, causal=causal, scale=0.3)
    want = ref.backward(do, q, k, v, r_out, r_lse.float(), causal=causal, scale=0.3)
    assert len(grads) == 3
    for got, w, x in zip(grads, want, (q, k, v)):
        assert got.shape == x.shape  # dk, dv keep the KV heads (GQA native)
        torch.testing.assert_close(got, w, rtol=0, atol=1e-12)


def test_flash_attn_empty_rows_get_the_contracts_minus_inf():
    """flash-attn marks a row that sees no key with lse = +inf; merge_partial would give it
    the whole merged row (NaN): the adapter returns the contract's -inf."""
    ns = _v27_plain()
    plain = ns._flash_attn_forward

    @functools.wraps(plain)  # the adapter reads the signature
    def empty_row_0(*a, **kw):
        res = list(plain(*a, **kw))
        res[1] = res[1].clone()
        res[1][..., 0] = float("inf")  # as flash-attn writes an empty row
        return tuple(res)

    ns._flash_attn_forward = empty_row_0
    q = torch.randn(4, 1, 2, 16, dtype=torch.float64)
    _, lse = kn.FlashAttnKernel(ns).forward(q, q, q, causal=True, scale=0.25)
    assert (lse[..., 0] == float("-inf")).all() and torch.isfinite(lse[..., 1:]).all()


def test_flash_attn_unknown_signature_is_refused():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
        raise AssertionError("never called")

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal):
        raise AssertionError("never called")

    ns = types.SimpleNamespace(
        __version__="2.0.4",
        _flash_attn_forward=_flash_attn_forward,
        _flash_attn_backward=_flash_attn_backward,
    )
    with pytest.raises(NotImplementedError, match="flash-attn 2.0.4.*neither window_size"):
        kn.FlashAttnKernel(ns)
    ns26 = _v26()

    def fwd_new(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                return_softmax, sink_tokens):  # fmt: skip
        raise AssertionError("never called")

    ns26._flash_attn_forward = fwd_new
    with pytest.raises(NotImplementedError, match=r"parameters \['sink_tokens'\] this adapter"):
        kn.FlashAttnKernel(ns26).forward(*(torch.zeros(2, 1, 1, 8),) * 3, causal=False, scale=1.0)


# ---- PyTorch's CUDA SDPA ops, through their meta kernels -----------------------------------


@pytest.mark.parametrize(
    "cls", [kn.SdpaFlashKernel, kn.SdpaEfficientKernel, kn.SdpaCudnnKernel, st.kernels.SdpaKernel]
)
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
def test_sdpa_cuda_ops_wiring_on_meta(cls, hq, hkv):
    sq, b, d = 40, 2, 64  # 40 rows: efficient attention pads its lse to 64
    q = torch.empty(sq, b, hq, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(sq, b, hkv, d, dtype=torch.bfloat16, device="meta")
    ker = cls()
    out, lse = ker.forward(q, k, k, causal=True, scale=0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    grads = ker.backward(q, q, k, k, out, lse, causal=True, scale=0.125)
    assert len(grads) == 3
    for g, x in zip(grads, (q, k, k)):
        assert g.shape == x.shape and g.dtype == x.dtype


# ---- Transformer Engine stand-ins, one per generation of fused_attn_fwd / _bwd ------------


class _DType(enum.Enum):  # transformer_engine_torch.DType; kFloat64 is the stand-ins' own
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat64 = 99


class _Backend(enum.Enum):  # transformer_engine_torch.NVTE_Fused_Attn_Backend
    NVTE_No_Backend = -1
    NVTE_F16_max512_seqlen = 0
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2


_TE_DTYPE = {
    torch.float32: _DType.kFloat32,
    torch.float16: _DType.kFloat16,
    torch.bfloat16: _DType.kBFloat16,
    torch.float64: _DType.kFloat64,  # not in TE: lets the stand-ins check to 1e-10
}
_FUSED_BACKENDS_1X = {
    "F16_max512_seqlen": _Backend.NVTE_F16_max512_seqlen,
    "F16_arbitrary_seqlen": _Backend.NVTE_F16_arbitrary_seqlen,
    "FP8": _Backend.NVTE_FP8,
    "No_Backend": _Backend.NVTE_No_Backend,
}
_FUSED_BACKENDS_2_18 = {k: v for k, v in _FUSED_BACKENDS_1X.items() if k != "F16_max512_seqlen"}


def _te_format(layout: str) -> str:
    """The one format of a separate-tensor layout; packed ones (TE's default "sbh3d") refused."""
    fmt = layout.split("_")[0]
    if fmt not in ("sbhd", "bshd") or layout != f"{fmt}_{fmt}_{fmt}":
        raise NotImplementedError(f"the stand-in reads only separate sbhd/bshd, not {layout!r}")
    return fmt


def _te_read(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """A tensor as TE sees it (a data pointer and a shape in ``fmt``) -> [s, b, h, d]."""
    assert x.is_contiguous(), "TE reads a data pointer and a shape: strides are ignored"
    return x if fmt == "sbhd" else x.transpose(0, 1)


def _te_write(fmt: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x if fmt == "sbhd" else x.transpose(0, 1)).to(dtype).contiguous()


def _te_scores(a: dict, q, k, scale):
    """Scaled scores (b, hq, sq, sk) in float64, masked per attn_mask_type and window_size
    (cuDNN's diagonal band as TE sets it: left bound ``left + 1``, right bound ``right``,
    on the top-left diagonal or, with ``bottom_right_diagonal``, the bottom-right one);
    k's heads broadcast."""
    sq, b, hq, _ = q.shape
    sk, _, hkv, _ = k.shape
    kd = k.double().permute(1, 2, 0, 3).repeat_interleave(hq // hkv, dim=1)
    s = q.double().permute(1, 2, 0, 3) @ kd.transpose(-1, -2) * scale
    ones = torch.ones(sq, sk, dtype=torch.bool)
    mask = {
        "no_mask": None,
        "causal": ones.triu(1),  # top-left: query i sees keys <= i
        "causal_bottom_right": ones.triu(sk - sq + 1),
    }[a["attn_mask_type"]]
    left, right = a.get("window_size", (-1, -1))
    if (left, right) != (-1, -1):
        shift = sk - sq if a.get("bottom_right_diagonal") else 0
        off = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1) - shift  # j - i
        band = torch.zeros(sq, sk, dtype=torch.bool)
        if left != -1:
            band |= off < -left
        if right != -1:
            band |= off > right
        mask = band if mask is None else mask | band
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def _te_common_checks(te, a: dict, q, k) -> None:
    assert a["fused_attention_backend"] is te.FusedAttnBackend["F16_arbitrary_seqlen"]
    window = (-1, 0) if a["attn_mask_type"] == "causal" else (-1, -1)
    assert a["dropout"] == 0.0
    if tuple(a["window_size"]) != window:
        # a window band: what TE's backend table (fused_attn.cpp) takes for F16 with cuDNN
        # 9.6+ on the top-left diagonal: no mask from 2.16 (NO_MASK + bidirectional SWA),
        # sq <= skv, no dropout or bias
        major, minor = (int(x) for x in te.version.split(".")[:2])
        assert (major, minor) >= (2, 16), "before TE 2.16 a no-mask window needs right == 0"
        assert a["attn_mask_type"] == "no_mask" and a["bottom_right_diagonal"] is False
        assert all(x >= -1 for x in a["window_size"])
        assert a["max_seqlen_q"] <= a["max_seqlen_kv"], "TE: no window backend for sq > skv"
    assert a.get("cuda_graph", False) is False  # not capturing here
    assert a["attn_bias_type"] == "no_bias" and a.get("attn_bias") is None
    assert a.get("softmax_type", "vanilla") == "vanilla"
    assert a.get("bottom_right_diagonal") in (None, a["attn_mask_type"] == "causal_bottom_right")
    if "qkv_dtype" in a:
        assert a["qkv_dtype"] is te.TE_DType[q.dtype]
    else:
        assert a["fake_dtype"] is q.dtype
    for which, x in (("q", q), ("kv", k)):
        n, b = x.shape[:2]
        cu = a[f"cu_seqlens_{which}"]
        assert a[f"max_seqlen_{which}"] == n and cu.dtype == torch.int32
        assert torch.equal(cu, torch.arange(0, (b + 1) * n, n, dtype=torch.int32))


# THD softmax statistics by generation: [n, h, max_q, 1] (1.x, cuDNN < 9.6), [bucket(t), h, 1]
# (1.13 - 2.10 with cuDNN >= 9.6), [t, h, 1] (2.11+).
_TE_THD_STATS = {"1.12.0": "padded", "2.4.0": "bucketed", "2.13.0": "exact", "2.18.0": "exact"}


def _te_max_tokens(t: int) -> int:  # TE's get_max_tokens: the bucketed stats rows
    if t <= 1024:
        return 1024
    if t <= 32768:
        return 1 << (t - 1).bit_length()
    return -(-t // 32768) * 32768


def _te_thd_setup(te, a: dict):
    """Checks of a THD call; -> (q, k, v [t, h, d], cu_q, cu_k lists, per-sequence mask)."""
    assert a["qkv_layout"] == "thd_thd_thd" and a.get("o_format", "thd") == "thd"
    assert a["fused_attention_backend"] is te.FusedAttnBackend["F16_arbitrary_seqlen"]
    mask = a["attn_mask_type"]
    assert mask in ("padding", "padding_causal"), "TE refuses THD without a padding mask"
    window = (-1, 0) if mask == "padding_causal" else (-1, -1)
    assert a["dropout"] == 0.0 and tuple(a["window_size"]) == window
    assert a["attn_bias_type"] == "no_bias" and a.get("attn_bias") is None
    assert a.get("bottom_right_diagonal") in (None, False)
    q, k, v = a["q"], a["k"], a["v"]
    for x in (q, k, v):
        assert x.dim() == 3 and x.is_contiguous(), "TE reads a data pointer and a shape"
    cu = {}
    for which, x in (("q", q), ("kv", k)):
        c = a[f"cu_seqlens_{which}"]
        assert c.dtype == torch.int32 and torch.equal(a[f"cu_seqlens_{which}_padded"], c)
        c = c.tolist()
        lens = [y - z for z, y in zip(c, c[1:])]
        assert c[0] == 0 and c[-1] == x.shape[0] and min(lens) > 0
        assert a[f"max_seqlen_{which}"] == max(lens)
        cu[which] = c
    return q, k, v, cu["q"], cu["kv"], ("causal" if mask == "padding_causal" else "no_mask")


def _te_thd_fwd(te, a: dict):
    q, k, v, cq, ck, mask = _te_thd_setup(te, a)
    hq, hkv = q.shape[1], k.shape[1]
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs = q[cq[i] : cq[i + 1]].unsqueeze(1)
        ks, vs = (x[ck[i] : ck[i + 1]].unsqueeze(1) for x in (k, v))
        if mask == "causal":
            assert qs.shape[0] == ks.shape[0]
        sc = _te_scores({"attn_mask_type": mask}, qs, ks, a["attn_scale"])  # (1, hq, sq, sk)
        lse = torch.logsumexp(sc, dim=-1, keepdim=True)
        vd = vs.double().permute(1, 2, 0, 3).repeat_interleave(hq // hkv, dim=1)
        outs.append((torch.exp(sc - lse) @ vd)[0].transpose(0, 1))  # [sq, hq, d]
        lses.append(lse[0, :, :, 0])  # [hq, sq]
    lse = torch.cat(lses, dim=1)  # [hq, t]
    t, n, form = q.shape[0], len(cq) - 1, _TE_THD_STATS[te.version]
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if form == "padded":
        max_q = a["max_seqlen_q"]
        stats = torch.full((n, hq, max_q, 1), 7.0, dtype=sdt)  # padding rows: never read
        for i in range(n):
            stats[i, :, : cq[i + 1] - cq[i], 0] = lse[:, cq[i] : cq[i + 1]]
    else:
        rows = _te_max_tokens(t) if form == "bucketed" else t
        stats = torch.full((rows, hq, 1), 7.0, dtype=sdt)
        stats[:t, :, 0] = lse.transpose(0, 1)
    rng_state = torch.tensor([1234, 0], dtype=torch.int64)
    return torch.cat(outs).to(q.dtype), [stats, rng_state]


def _te_thd_bwd(te, a: dict):
    q, k, v, cq, ck, mask = _te_thd_setup(te, a)
    assert a.get("dqkv_layout", "thd_thd_thd") == "thd_thd_thd"
    assert a.get("do_format", "thd") == "thd"
    o, do = a["o"], a["d_o"]
    stats, rng_state = a["aux_ctx_tensors"]
    t, hq, n, form = q.shape[0], q.shape[1], len(cq) - 1, _TE_THD_STATS[te.version]
    if form == "padded":
        assert stats.shape == (n, hq, a["max_seqlen_q"], 1)
    else:
        assert stats.shape == ((_te_max_tokens(t) if form == "bucketed" else t), hq, 1)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
    for i in range(n):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if form == "padded":
            st_i = stats[i : i + 1, :, : cq[i + 1] - cq[i]]
        else:
            st_i = stats[qs].permute(2, 1, 0).unsqueeze(-1)  # (1, hq, sq, 1)
        g = _te_grads(
            mask, a["attn_scale"], *(x[sl].unsqueeze(1) for x, sl in
                                     ((q, qs), (k, ks), (v, ks), (o, qs), (do, qs))),
            st_i,
        )  # fmt: skip
        for buf, sl, val in zip((dq, dk, dv), (qs, ks, ks), g):
            buf[sl] = val[:, 0]
    return [x.to(q.dtype) for x in (dq, dk, dv)] + [None] * (2 if "softmax_type" in a else 1)


def _te_fwd(te, a: dict):
    """fused_attn_fwd's work: (out in o_format, [softmaxStats [b, h, sq, 1], rng_state])."""
    te.calls.append(("fwd", a))
    if a["qkv_layout"].startswith("thd"):
        return _te_thd_fwd(te, a)
    fmt = _te_format(a["qkv_layout"])
    q, k, v = (_te_read(fmt, a[n]) for n in ("q", "k", "v"))
    _te_common_checks(te, a, q, k)
    assert a["is_training"] is True and a.get("return_max_logit", False) is False
    assert isinstance(a["rng_gen"], torch.Generator)  # never the default generator
    hq, hkv = q.shape[2], k.shape[2]
    s = _te_scores(a, q, k, a["attn_scale"])
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (b, hq, sq, 1)
    vd = v.double().permute(1, 2, 0, 3).repeat_interleave(hq // hkv, dim=1)
    out = (torch.exp(s - lse) @ vd).permute(2, 0, 1, 3)  # [sq, b, hq, d]
    stats = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)  # TE: fp32
    rng_state = torch.tensor([1234, 0], dtype=torch.int64)
    return _te_write(a.get("o_format", fmt), out, q.dtype), [stats, rng_state]


def _te_bwd(te, a: dict):
    """fused_attn_bwd's work from the given statistics: [dq, dk, dv, dbias(, d_offset)]."""
    te.calls.append(("bwd", a))
    if a["qkv_layout"].startswith("thd"):
        return _te_thd_bwd(te, a)
    fmt = _te_format(a["qkv_layout"])
    q, k, v = (_te_read(fmt, a[n]) for n in ("q", "k", "v"))
    o = _te_read(a.get("o_format", fmt), a["o"])
    do = _te_read(a.get("do_format", fmt), a["d_o"])
    _te_common_checks(te, a, q, k)
    assert a["deterministic"] is False and o.dtype == do.dtype == q.dtype
    if "dqkv_dtype" in a:
        assert a["dqkv_dtype"] is te.TE_DType[q.dtype]
    stats, rng_state = a["aux_ctx_tensors"]
    sq, b, hq, d = q.shape
    assert stats.shape == (b, hq, sq, 1) and stats.is_contiguous()
    assert stats.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64
    grads = _te_grads(a, a["attn_scale"], q, k, v, o, do, stats)
    out_fmt = _te_format(a.get("dqkv_layout", a["qkv_layout"]))
    grads = [_te_write(out_fmt, x, q.dtype) for x in grads]
    return grads + [None] * (2 if "softmax_type" in a else 1)


def _te_grads(mask, scale, q, k, v, o, do, stats):
    """dq, dk, dv [s, b, h, d] (float64) of attention from the statistics (b, hq, sq, 1);
    ``mask``: the mask type, or the call's arguments (mask and window)."""
    sq, b, hq, d = q.shape
    sk, _, hkv, _ = k.shape
    g = hq // hkv
    spec = mask if isinstance(mask, dict) else {"attn_mask_type": mask}
    p = torch.exp(_te_scores(spec, q, k, scale) - stats.double())

    def bh(x, rep=1):  # [s, b, h, d] -> (b, h * rep, s, d) float64
        return x.double().permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)

    dod, kd, vd = bh(do), bh(k, g), bh(v, g)
    delta = (dod * bh(o)).sum(-1, keepdim=True)
    ds = p * (dod @ vd.transpose(-1, -2) - delta) * scale
    dq = ds @ kd
    dk = (ds.transpose(-1, -2) @ bh(q)).reshape(b, hkv, g, sk, d).sum(2)
    dv = (p.transpose(-1, -2) @ dod).reshape(b, hkv, g, sk, d).sum(2)
    return [x.permute(2, 0, 1, 3) for x in (dq, dk, dv)]


_META_QKV, _META_O, _META_S = 0, 1, 2  # TE 1.x's FP8 meta indices (defaults only)


def _te_1_12(te):  # TE 1.11 - 1.13
    def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                       q, k, v, qkv_dtype, fused_attention_backend, attn_bias=None,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, d_scale_qkv=None,
                       d_scale_qkv_offset=_META_QKV, d_scale_s=None, d_scale_s_offset=_META_S,
                       q_scale_s=None, q_scale_s_offset=_META_S, q_scale_o=None,
                       q_scale_o_offset=_META_O, amax_s=None, amax_s_offset=_META_S,
                       amax_o=None, amax_o_offset=_META_O, attn_scale=None, dropout=0.0,
                       fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", window_size=(-1, -1), rng_gen=None):  # fmt: skip
        return _te_fwd(te, dict(locals()))

    def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o,
                       d_o, qkv_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, d_scale_qkv=None,
                       d_scale_s=None, d_scale_o=None, d_scale_do=None, d_scale_dp=None,
                       q_scale_s=None, q_scale_dp=None, q_scale_dqkv=None, amax_dp=None,
                       amax_dqkv=None, attn_scale=None, dropout=0.0, fast_zero_fill=True,
                       qkv_layout="sbh3d", attn_bias_type="no_bias", attn_mask_type="padding",
                       window_size=(-1, -1), deterministic=False):  # fmt: skip
        return _te_bwd(te, dict(locals()))

    return "1.12.0", fused_attn_fwd, fused_attn_bwd, _FUSED_BACKENDS_1X


def _te_2_4(te):  # TE 2.2 - 2.7
    def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                       q, k, v, fake_dtype, fused_attention_backend, attn_bias=None,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None,
                       page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                       dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d",
                       attn_bias_type="no_bias", attn_mask_type="padding",
                       window_size=(-1, -1), rng_gen=None):  # fmt: skip
        return _te_fwd(te, dict(locals()))

    def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o,
                       d_o, fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, s_quantizer=None,
                       dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
                       fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", window_size=(-1, -1),
                       deterministic=False):  # fmt: skip
        return _te_bwd(te, dict(locals()))

    return "2.4.0", fused_attn_fwd, fused_attn_bwd, _FUSED_BACKENDS_1X


def _te_2_13(te):  # TE 2.12 - 2.14: bottom_right_diagonal and cuda_graph, dqkv_dtype kept
    def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                       q, k, v, fake_dtype, fused_attention_backend, attn_bias=None,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None,
                       page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                       dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d",
                       attn_bias_type="no_bias", attn_mask_type="padding",
                       softmax_type="vanilla", window_size=(-1, -1), bottom_right_diagonal=None,
                       rng_gen=None, softmax_offset=None, return_max_logit=False,
                       cuda_graph=False):  # fmt: skip
        return _te_fwd(te, dict(locals()))

    def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o,
                       d_o, fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, s_quantizer=None,
                       dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
                       fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                       bottom_right_diagonal=None, deterministic=False,
                       cuda_graph=False):  # fmt: skip
        return _te_bwd(te, dict(locals()))

    return "2.13.0", fused_attn_fwd, fused_attn_bwd, _FUSED_BACKENDS_1X


def _te_2_18(te):  # TE 2.15 - 2.18
    def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                       q, k, v, fake_dtype, fused_attention_backend, attn_bias=None,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None,
                       page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                       dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd",
                       qkv_scale_inv_format=None, attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                       bottom_right_diagonal=None, rng_gen=None, softmax_offset=None,
                       return_max_logit=False, cuda_graph=False):  # fmt: skip
        return _te_fwd(te, dict(locals()))

    def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o,
                       d_o, fake_dtype, aux_ctx_tensors, fused_attention_backend,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, s_quantizer=None,
                       dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
                       fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd",
                       do_format="sbhd", dqkv_layout="sbh3d", qkv_scale_inv_format=None,
                       do_scale_inv_format=None, attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                       bottom_right_diagonal=None, deterministic=False,
                       cuda_graph=False):  # fmt: skip
        return _te_bwd(te, dict(locals()))

    return "2.18.0", fused_attn_fwd, fused_attn_bwd, _FUSED_BACKENDS_2_18


TE_VERSIONS = {"1.12": _te_1_12, "2.4": _te_2_4, "2.13": _te_2_13, "2.18": _te_2_18}


def _te_stand_in(make) -> types.SimpleNamespace:
    """The stand-in ``transformer_engine`` modules of one generation, and its call log."""
    te = types.SimpleNamespace(calls=[], TE_DType=_TE_DTYPE)
    version, fwd, bwd, backends = make(te)
    te.FusedAttnBackend = backends
    fa = types.ModuleType("transformer_engine.pytorch.cpp_extensions.fused_attn")
    fa.fused_attn_fwd, fa.fused_attn_bwd, fa.FusedAttnBackend = fwd, bwd, backends
    consts = types.ModuleType("transformer_engine.pytorch.constants")
    consts.TE_DType = _TE_DTYPE
    top = types.ModuleType("transformer_engine")
    top.__version__ = version
    top.pytorch = types.ModuleType("transformer_engine.pytorch")
    top.pytorch.cpp_extensions = types.ModuleType("transformer_engine.pytorch.cpp_extensions")
    top.pytorch.cpp_extensions.fused_attn, top.pytorch.constants = fa, consts
    te.version, te.fused_attn = version, fa
    te.modules = {
        "transformer_engine": top,
        "transformer_engine.pytorch": top.pytorch,
        "transformer_engine.pytorch.cpp_extensions": top.pytorch.cpp_extensions,
        "transformer_engine.pytorch.cpp_extensions.fused_attn": fa,
        "transformer_engine.pytorch.constants": consts,
    }
    return te


@pytest.fixture
def te_install(monkeypatch):
    """Put one generation's stand-in in sys.modules; ``cpu=True`` lets the adapter take CPU
    (and float64) tensors, which it refuses outside these tests."""

    def install(version: str, cpu: bool = True) -> types.SimpleNamespace:
        te = _te_stand_in(TE_VERSIONS[version])
        for name, mod in te.modules.items():
            monkeypatch.setitem(sys.modules, name, mod)
        if cpu:
            spec = kn.TEKernel.spec
            wide = dict(devices=frozenset({"cuda", "cpu"}), dtypes=spec.dtypes | {torch.float64})
            monkeypatch.setattr(kn.TEKernel, "spec", dataclasses.replace(spec, **wide))
        return te

    kn_choice._instance.cache_clear()
    yield install
    kn_choice._instance.cache_clear()


@pytest.mark.parametrize("version", list(TE_VERSIONS))
def test_te_api_detection(te_install, version):
    te = te_install(version)
    ker = kn.TEKernel()  # imports the stand-in from sys.modules
    assert ker.api.version == te.version
    assert ker.api.dtype_arg == ("qkv_dtype" if version == "1.12" else "fake_dtype")
    assert ker.api.dqkv_dtype == (version != "2.18")
    assert ker.api.needs_te_dtype == (version != "2.18")
    h100 = kn.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100)
    built = kn.build_kernel("te", query=h100, installed=_all, env={})
    assert isinstance(built, kn.TEKernel) and built.api == ker.api


def _sbhd_views(s, b, h, d, g, n_bufs=1):
    """Tensors laid out as StarTrail's team buffers give them: strided [s, b, h, d] views."""
    buf = torch.randn(s, n_bufs, b, h, d, generator=g, dtype=torch.float64)
    return [buf[:, i] for i in range(n_bufs)]


@pytest.mark.parametrize("version", list(TE_VERSIONS))
@pytest.mark.parametrize(
    "causal,sq,sk",
    [(True, 6, 6), (False, 6, 6), (False, 6, 10), (False, 10, 4), (True, 4, 7)],
)  # plans: causal only on diagonal blocks (sq == sk); (True, 4, 7) pins the top-left mask
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_te_adapter_computes_attention(te_install, version, causal, sq, sk, hq, hkv):
    te_install(version)
    ker, ref = kn.TEKernel(), TorchKernel()
    g = torch.Generator().manual_seed(3)
    b, d, scale = 2, 16, 0.3
    (q,) = _sbhd_views(sq, b, hq, d, g)
    k, v = _sbhd_views(sk, b, hkv, d, g, 2)  # k, v interleaved like kv_cur[ks, 0 / 1]
    assert not k.is_contiguous()
    out, lse = ker.forward(q, k, v, causal=causal, scale=scale)
    r_out, r_lse = ref.forward(q, k, v, causal=causal, scale=scale)
    assert out.shape == q.shape and lse.shape == (b, hq, sq)
    torch.testing.assert_close(out, r_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, r_lse, rtol=0, atol=1e-10)
    # The backward gets the final (merged) out and lse of the rows: merge in another block.
    k2, v2 = _sbhd_views(5, b, hkv, d, g, 2)
    o2, l2 = ref.forward(q, k2, v2, causal=False, scale=scale)
    fin_out, fin_lse = r_out.clone(), r_lse.clone()
    st.kernels.merge_partial(fin_out, fin_lse, o2, l2)
    (do,) = _sbhd_views(sq, b, hq, d, g)
    grads = ker.backward(do, q, k, v, fin_out, fin_lse, causal=causal, scale=scale)
    want = ref.backward(do, q, k, v, fin_out, fin_lse, causal=causal, scale=scale)
    assert len(grads) == 3
    for got, w, x in zip(grads, want, (q, k, v)):
        assert got.shape == x.shape  # dk, dv keep the KV heads (GQA natively)
        torch.testing.assert_close(got, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("version", list(TE_VERSIONS))
@pytest.mark.parametrize("causal", [True, False])
def test_te_arguments(te_install, version, causal):
    """What reaches TE for bf16 inputs: layout, mask, backend, dtypes, cu_seqlens, stats."""
    te = te_install(version, cpu=True)
    ker = kn.TEKernel()
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(8, 2, h, 32, generator=g).bfloat16() for h in (8, 2, 2, 8))
    out, lse = ker.forward(q, k, v, causal=causal, scale=0.2)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    r_out, r_lse = TorchKernel().forward(q, k, v, causal=causal, scale=0.2)
    torch.testing.assert_close(out, r_out, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, r_lse, rtol=0, atol=1e-5)
    grads = ker.backward(do, q, k, v, r_out.float(), r_lse, causal=causal, scale=0.2)
    want = TorchKernel().backward(do, q, k, v, r_out.float(), r_lse, causal=causal, scale=0.2)
    assert len(grads) == 3
    for got, w in zip(grads, want):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), w.float(), rtol=0, atol=5e-2)
    (_, f), (_, bw) = te.calls
    mask = "causal" if causal else "no_mask"
    for a in (f, bw):
        assert a["qkv_layout"] == "sbhd_sbhd_sbhd" and a["attn_mask_type"] == mask
        assert a["fused_attention_backend"] is _Backend.NVTE_F16_arbitrary_seqlen
        assert a["attn_scale"] == 0.2 and a["dropout"] == 0.0 and a["attn_bias_type"] == "no_bias"
        assert a["max_seqlen_q"] == a["max_seqlen_kv"] == 8
        assert torch.equal(a["cu_seqlens_q"], torch.tensor([0, 8, 16], dtype=torch.int32))
        if version == "1.12":
            assert a["qkv_dtype"] is _DType.kBFloat16
        else:
            assert a["fake_dtype"] is torch.bfloat16
    assert f["is_training"] is True
    stats, rng_state = bw["aux_ctx_tensors"]
    assert torch.equal(stats, r_lse.unsqueeze(-1)) and stats.dtype == torch.float32
    assert torch.equal(rng_state, torch.zeros(2, dtype=torch.int64))
    if version in ("2.4", "2.13"):
        assert bw["dqkv_dtype"] is _DType.kBFloat16
    for a in (f, bw):
        assert tuple(a["window_size"]) == ((-1, 0) if causal else (-1, -1))
    if version in ("2.13", "2.18"):
        assert f["bottom_right_diagonal"] is bw["bottom_right_diagonal"] is False
        assert f["cuda_graph"] is bw["cuda_graph"] is False
    if version == "2.18":
        assert f["o_format"] == bw["o_format"] == bw["do_format"] == "sbhd"
        assert bw["dqkv_layout"] == "sbhd_sbhd_sbhd"
        assert f["return_max_logit"] is False and f["bottom_right_diagonal"] is False
        assert f["softmax_type"] == bw["softmax_type"] == "vanilla"


def test_te_under_cuda_graph_capture(te_install, monkeypatch):
    """While a CUDA graph is captured: cuda_graph=True, no private generator (only the
    default one is registered with the graph), cu_seqlens not taken from the cache."""
    te_install("2.18")
    ker = kn.TEKernel()
    seen = []

    def fwd(**kw):
        seen.append(kw)
        sq, b, h, _ = kw["q"].shape
        return kw["q"].clone(), [torch.zeros(b, h, sq, 1), torch.zeros(2, dtype=torch.int64)]

    ker._fwd = fwd
    x = torch.randn(4, 1, 2, 8, dtype=torch.float64)
    ker.forward(x, x, x, causal=True, scale=1.0)  # not capturing
    monkeypatch.setattr(kn_te_kernel, "_capturing", lambda device: True)
    ker.forward(x, x, x, causal=True, scale=1.0)
    free, captured = seen
    assert isinstance(free["rng_gen"], torch.Generator) and free["cuda_graph"] is False
    assert captured["rng_gen"] is None and captured["cuda_graph"] is True
    assert captured["cu_seqlens_q"] is not free["cu_seqlens_q"]  # built anew, not cached
    assert torch.equal(captured["cu_seqlens_q"], free["cu_seqlens_q"])


def test_te_refuses_what_it_cannot_run(te_install):
    te_install("2.18", cpu=False)  # the production device and dtype checks
    ker = kn.TEKernel()
    x = torch.zeros(4, 1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"kernel 'te' runs on \['cuda'\] tensors"):
        ker.forward(x, x, x, causal=True, scale=1.0)
    with pytest.raises(NotImplementedError, match=r"runs on \['cuda'\] tensors"):
        ker.backward(x, x, x, x, x, torch.zeros(1, 2, 4), causal=True, scale=1.0)
    te_install("2.18", cpu=True)
    with pytest.raises(NotImplementedError, match=r"takes q, k, v of one dtype in"):
        ker.forward(x.float(), x.float(), x.float(), causal=True, scale=1.0)
    # TE reads batch and head_dim from q alone: k, v must agree
    for kv in (torch.zeros(4, 2, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 1, 2, 16)):
        with pytest.raises(ValueError, match="must share batch and head_dim"):
            ker.forward(x, kv.to(x.dtype), kv.to(x.dtype), causal=False, scale=1.0)
    h100 = dict(device_type="cuda", capability=(9, 0))
    for query, installed, why in [
        (kn.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100), _none,
         "'transformer_engine' package is not installed"),
        (kn.KernelQuery("cpu", torch.bfloat16, 64), _all, r"runs on \['cuda'\], not 'cpu'"),
        (kn.KernelQuery(dtype=torch.float32, head_dim=64, **CUDA_H100), _all, "not float32"),
        (kn.KernelQuery("cuda", torch.float16, 192, (8, 0), 90100), _all,
         r"head_dim 192 > 128 needs compute capability \(9, 0\) and cuDNN >= 90500"),
        (kn.KernelQuery(dtype=torch.float16, head_dim=256, cudnn_version=90100, **h100), _all,
         "head_dim 256 > 128 needs"),
        (kn.KernelQuery(dtype=torch.float16, head_dim=264, **CUDA_H100), _all, "head_dim 264 > 256"),
        (kn.KernelQuery(dtype=torch.float16, head_dim=100, **CUDA_H100), _all, "multiple of 8"),
        (kn.KernelQuery("cuda", torch.float16, 64, (7, 5), 90100), _all, "capability >= \\(8, 0\\)"),
        (kn.KernelQuery("cuda", torch.float16, 64, (8, 0), 8907), _all, "cuDNN >= 90000"),
        (kn.KernelQuery("cuda", torch.float16, 64, (10, 0), 90500), _all, "cuDNN >= 90700"),
    ]:  # fmt: skip
        with pytest.raises(NotImplementedError, match=why):
            kn.choose_kernel("te", query, installed, env={})
    ok = kn.KernelQuery(dtype=torch.bfloat16, head_dim=256, cudnn_version=90500, **h100)
    assert kn.choose_kernel("te", ok, _all, env={}) == ["te"]


def test_te_unknown_signature_is_refused():
    te = _te_stand_in(_te_2_18)
    fwd, bwd = te.fused_attn.fused_attn_fwd, te.fused_attn.fused_attn_bwd

    def newer_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k,
                  v, fake_dtype, fused_attention_backend, attn_scale=None, dropout=0.0,
                  qkv_layout="sbh3d", attn_bias_type="no_bias", attn_mask_type="padding",
                  window_size=(-1, -1), score_mod=None):  # fmt: skip
        raise AssertionError("never called")

    with pytest.raises(NotImplementedError, match=r"Transformer Engine 2\.19\.0: fused_attn_fwd "
                       r"has parameters \['score_mod'\] this adapter does not know"):  # fmt: skip
        kn.detect_te_api(newer_fwd, bwd, "2.19.0")

    def fwd_1_8(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                qkv_dtype, fused_attention_backend, attn_bias=None, attn_scale=None,
                dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                attn_mask_type="padding", rng_gen=None):  # fmt: skip
        raise AssertionError("never called")

    with pytest.raises(NotImplementedError, match=r"Transformer Engine 1\.8\.0: .*lack "
                       r"\['window_size'.*supported: Transformer Engine 1\.9 - 2\.18"):  # fmt: skip
        kn.detect_te_api(fwd_1_8, bwd, "1.8.0")
    with pytest.raises(NotImplementedError, match="exactly one of qkv_dtype / fake_dtype"):
        kn.detect_te_api(_te_stand_in(_te_1_12).fused_attn.fused_attn_fwd, bwd, "mixed")
    fa = types.SimpleNamespace(fused_attn_fwd=fwd, fused_attn_bwd=bwd, FusedAttnBackend={})
    with pytest.raises(NotImplementedError, match=r"2\.18\.0.*FusedAttnBackend"):
        kn.TEKernel(fa, version="2.18.0")


# ---- TE: sliding windows (window_size on the top-left diagonal, TE 2.12+, cuDNN 9.6+) -------
def test_te_band_pieces_cover_each_band_pair_once():
    """Every trimmed band call (each row and key with a pair) as TE calls: rows disjoint and
    in order, no piece with more rows than keys (TE's window backends need sq <= skv),
    windows >= -1, and exactly the band's pairs."""
    n = 0
    for sq in range(1, 10):
        for sk in range(1, 10):
            for lo in [None, *range(-9, 1)]:
                for hi in [None, *range(0, 10)]:
                    pairs = {(i, j) for i in range(sq) for j in range(sk)
                             if (lo is None or j - i >= lo) and (hi is None or j - i <= hi)}  # fmt: skip
                    if {i for i, _ in pairs} != set(range(sq)) or {j for _, j in pairs} != set(
                        range(sk)
                    ):
                        continue  # not a trimmed call
                    got, rows = set(), []
                    pieces = kn_te.te_band_pieces(sq, sk, lo, hi)
                    assert len(pieces) == 1 or sq > sk
                    for a, e, c0, c1, left, right in pieces:
                        # TE: a window only with sq <= skv (a plain full call has none)
                        plain = (left, right) == (-1, -1)
                        assert (e - a <= c1 - c0 or plain) and left >= -1 and right >= -1
                        rows += range(a, e)
                        got |= {(i, j) for i in range(a, e) for j in range(c0, c1)
                                if (left == -1 or (j - c0) - (i - a) >= -left)
                                and (right == -1 or (j - c0) - (i - a) <= right)}  # fmt: skip
                    assert rows == list(range(sq)) and got == pairs, (sq, sk, lo, hi)
                    n += 1
    assert n > 1000
    with pytest.raises(ValueError, match="not trimmed"):
        kn_te.te_band_pieces(4, 4, 1, 3)


@pytest.mark.parametrize("version", ["2.18"])
@pytest.mark.parametrize(
    "sq,sk,band",
    [
        (6, 6, (None, 0)),
        (6, 6, (-2, 0)),
        (6, 9, (-1, 4)),
        (5, 5, (0, 3)),
        (9, 4, (-6, 0)),
        (8, 3, (-5, 0)),
        (7, 7, (-1, 1)),
        (6, 8, (None, 2)),
    ],
)  # fmt: skip  (9 x 4 and 8 x 3: more rows than keys, cut into pieces)
def test_te_adapter_runs_window_bands(te_install, version, sq, sk, band):
    te = te_install(version)
    ker, ref = kn.TEKernel(cudnn_version=90600), TorchKernel()
    assert ker.supports_band
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d, scale = 2, 4, 2, 8, 0.4
    (q,) = _sbhd_views(sq, b, hq, d, g)
    k, v = _sbhd_views(sk, b, hkv, d, g, 2)
    out, lse = ker.forward(q, k, v, causal=False, scale=scale, band=band)
    r_out, r_lse = ref.forward(q, k, v, causal=False, scale=scale, band=band)
    torch.testing.assert_close(out, r_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, r_lse, rtol=0, atol=1e-10)
    k2, v2 = _sbhd_views(3, b, hkv, d, g, 2)  # the backward gets merged rows
    o2, l2 = ref.forward(q, k2, v2, causal=False, scale=scale)
    st.kernels.merge_partial(r_out, r_lse, o2, l2)
    (do,) = _sbhd_views(sq, b, hq, d, g)
    grads = ker.backward(do, q, k, v, r_out, r_lse, causal=False, scale=scale, band=band)
    want = ref.backward(do, q, k, v, r_out, r_lse, causal=False, scale=scale, band=band)
    for got, w, x in zip(grads, want, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, w, rtol=0, atol=1e-10)
    pieces = kn_te.te_band_pieces(sq, sk, *band)
    fwd = [a for kind, a in te.calls if kind == "fwd"]
    assert len(fwd) == len(pieces) == len(te.calls) // 2
    for a, (r0, r1, c0, c1, left, right) in zip(fwd, pieces):
        # (-1, 0): TE's own causal call; any other band: no mask and the window
        mask = "causal" if (left, right) == (-1, 0) else "no_mask"
        assert tuple(a["window_size"]) == (left, right) and a["attn_mask_type"] == mask
        assert a["bottom_right_diagonal"] is False
        assert (a["max_seqlen_q"], a["max_seqlen_kv"]) == (r1 - r0, c1 - c0)


def test_te_window_refusals(te_install):
    """Releases before 2.16 (whose backend table takes a no-mask window only with right ==
    0: 2.13 has the signature but not the backend), cuDNN before 9.6 and cuDNN 9.14.0 refuse
    windows by name, before any transfer (``resolve_kernel``); TE has no soft-capping."""
    x = torch.zeros(4, 1, 2, 8, dtype=torch.float64)
    for version, cudnn, why in [
        ("1.12", 90600, "need Transformer Engine >= 2.16 .*got 1.12.0"),
        ("2.4", 91000, "need Transformer Engine >= 2.16"),
        ("2.13", 91000, "need Transformer Engine >= 2.16 .*got 2.13.0"),
        ("2.18", 90500, "need cuDNN >= 90600, got 90500"),
        ("2.18", 91400, "on cuDNN 91400"),
        ("2.18", None, "need cuDNN >= 90600, got None"),  # no CUDA here: unknown
    ]:
        te_install(version)
        ker = kn.TEKernel(cudnn_version=cudnn)
        assert not ker.supports_band
        with pytest.raises(NotImplementedError, match=f"'te' does not run window .*{why}"):
            kn.resolve_kernel(x, ker, None, window=True)
        with pytest.raises(NotImplementedError, match=why):
            ker.forward(x, x, x, causal=False, scale=1.0, band=(-1, 0))
    te_install("2.18")
    ker = kn.TEKernel(cudnn_version=90600)
    assert kn.resolve_kernel(x, ker, None, window=True)[0] is ker
    with pytest.raises(NotImplementedError, match="'te' does not run softcap"):
        kn.resolve_kernel(x, ker, None, softcap=True)


@pytest.mark.parametrize("causal", [True, False])
def test_startrail_window_on_te_stand_in(te_install, causal):
    """StarTrail's windowed calls through TE (2.18 stand-in, cuDNN 9.6): out and every
    gradient against float64 over the whole sequence, for windows shorter than a chunk,
    spanning chunks and teams, and one-sided."""
    from test_window import _close, _inputs, reference

    from startrail_megatron.one_process import one_process_attention

    te = te_install("2.18")
    ker = kn.TEKernel(cudnn_version=90600)
    p, c = 8, 2
    n = p * 8
    for window in [(0, 0), (3, 1), (11, 0), (-1, 5)]:
        q, k, v, do = _inputs(n, seed=2)
        leaves = [[st.testing.shard(x, r, p, True).requires_grad_() for r in range(p)]
                  for x in (q, k, v)]  # fmt: skip
        outs = one_process_attention(*leaves, c, causal=causal, kernel=ker, window=window)
        torch.autograd.backward(outs, [st.testing.shard(do, r, p, True) for r in range(p)])
        want = reference(q, k, v, do, causal, window, 0.0)
        got = [outs, *([x.grad for x in xs] for xs in leaves)]
        for i in range(4):
            full = st.testing.unshard([t.detach() for t in got[i]], True)
            assert _close(full, want[i]), (window, i)
    assert any(tuple(a["window_size"]) not in ((-1, 0), (-1, -1)) for _, a in te.calls)
