"""GPU backends on CPU: selection, flash-attn signature adaptation, SDPA op wiring.

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
  padded lse, cuDNN's [b, h, s, 1] lse, flash's GQA gradients).
"""

from __future__ import annotations

import types

import pytest
import torch

import startrail_megatron as st
from startrail_megatron import backends as bk
from startrail_megatron.kernels import TorchKernel

CUDA_H100 = dict(device_type="cuda", capability=(9, 0), cudnn_version=90100)


def _all(_: str) -> bool:
    return True


def _none(_: str) -> bool:
    return False


@pytest.mark.parametrize(
    "query,installed,want",
    [
        (
            bk.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100),
            _all,
            ["flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch"],
        ),
        (
            bk.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100),
            _none,
            ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch"],
        ),
        (
            bk.KernelQuery(dtype=torch.float16, head_dim=192, **CUDA_H100),
            _all,
            ["flash_attn", "sdpa_flash", "sdpa_efficient", "torch"],
        ),  # cuDNN: head_dim <= 128
        (
            bk.KernelQuery(dtype=torch.float32, head_dim=128, **CUDA_H100),
            _all,
            ["sdpa_efficient", "torch"],
        ),
        (bk.KernelQuery(dtype=torch.float16, head_dim=100, **CUDA_H100), _all, ["torch"]),
        (
            bk.KernelQuery("cuda", torch.float16, 128, (7, 5), 90100),
            _all,
            ["sdpa_efficient", "torch"],
        ),  # Turing: no flash, no cuDNN SDPA
        (
            bk.KernelQuery("cuda", torch.bfloat16, 128, (8, 0), 8900),
            _all,
            ["flash_attn", "sdpa_flash", "sdpa_efficient", "torch"],
        ),  # cuDNN 8
        (bk.KernelQuery(dtype=torch.float64, head_dim=64, **CUDA_H100), _all, ["torch"]),
        (bk.KernelQuery("cpu", torch.bfloat16, 64), _all, ["sdpa", "torch"]),
        (bk.KernelQuery("cpu", torch.float64, 64), _all, ["torch"]),
        (bk.KernelQuery("mps", torch.float32, 64), _all, ["torch"]),
    ],
)
def test_auto_selection(query, installed, want):
    assert bk.choose_kernel("auto", query, installed, env={}) == want


def test_explicit_names_and_override():
    h100 = bk.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100)
    assert bk.choose_kernel("sdpa_cudnn", h100, _all, env={}) == ["sdpa_cudnn"]
    # the environment variable replaces "auto" only
    env = {bk.KERNEL_ENV: "sdpa_efficient"}
    assert bk.choose_kernel("auto", h100, _all, env=env) == ["sdpa_efficient"]
    assert bk.choose_kernel("sdpa_flash", h100, _all, env=env) == ["sdpa_flash"]
    with pytest.raises(NotImplementedError, match=r"kernel='flash_attn' cannot run.*not installed"):
        bk.choose_kernel("flash_attn", h100, _none, env={})
    cpu = bk.KernelQuery("cpu", torch.bfloat16, 64)
    with pytest.raises(NotImplementedError, match=r"STARTRAIL_KERNEL='sdpa_flash' cannot run"):
        bk.choose_kernel("auto", cpu, _all, env={bk.KERNEL_ENV: "sdpa_flash"})
    with pytest.raises(NotImplementedError, match=r"takes \['bfloat16', 'float16'\], not float32"):
        bk.choose_kernel("flash_attn", bk.KernelQuery(dtype=torch.float32, **CUDA_H100), _all, {})
    allowed = (
        r"allowed: \['auto', 'torch', 'sdpa', 'flash_attn', 'sdpa_flash', 'sdpa_cudnn', "
        r"'sdpa_efficient', 'te'\]"
    )
    with pytest.raises(ValueError, match=r"STARTRAIL_KERNEL='flash2' is not known; " + allowed):
        bk.choose_kernel("auto", cpu, _all, env={bk.KERNEL_ENV: "flash2"})
    with pytest.raises(ValueError, match=r"kernel='fa' is not known; " + allowed):
        st.get_kernel("fa")
    with pytest.raises(NotImplementedError, match="Transformer Engine.*no log-sum-exp"):
        bk.choose_kernel("te", h100, _all, env={})


def test_get_kernel_reads_the_environment(monkeypatch):
    monkeypatch.setenv(bk.KERNEL_ENV, "torch")
    assert st.get_kernel("auto", torch.float32).name == "torch"
    assert st.get_kernel("sdpa", torch.float32).name == "sdpa"
    monkeypatch.delenv(bk.KERNEL_ENV)
    assert st.get_kernel("auto", torch.float32).name == "sdpa"


def test_auto_skips_a_backend_whose_import_fails(monkeypatch):
    def broken():
        raise ImportError("flash_attn_2_cuda: undefined symbol")

    monkeypatch.setitem(bk._CONSTRUCTORS, "flash_attn", broken)
    h100 = bk.KernelQuery(dtype=torch.bfloat16, head_dim=128, **CUDA_H100)
    ker = bk.build_kernel("auto", query=h100, installed=_all, env={})
    assert ker.name == "sdpa_flash"
    with pytest.raises(ImportError, match="undefined symbol"):
        bk.build_kernel("flash_attn", query=h100, installed=_all, env={})


def test_lse_forms():
    lse = torch.randn(2, 3, 40)
    assert torch.equal(bk.lse_to_bhs(lse, 2, 3, 40), lse)
    padded = torch.nn.functional.pad(lse, (0, 24))
    assert torch.equal(bk.lse_to_bhs(padded, 2, 3, 40), lse)
    assert torch.equal(bk.lse_to_bhs(lse.unsqueeze(-1), 2, 3, 40), lse)
    padded_inf = bk._pad_rows(lse, 32)
    assert padded_inf.shape == (2, 3, 64) and padded_inf.is_contiguous()
    assert torch.equal(padded_inf[..., :40], lse) and torch.isposinf(padded_inf[..., 40:]).all()
    with pytest.raises(RuntimeError, match=r"expected \[2, 3, >= 41\]"):
        bk.lse_to_bhs(lse, 2, 3, 41)


# ---- flash-attn stand-ins, one per upstream signature --------------------------------------


def _ref_fwd(q, k, v, causal, scale):
    """Real attention for [b, s, h, d] inputs, checked like flash-attn's mha_fwd."""
    for x in (q, k, v):
        assert x.stride(-1) == 1, "flash-attn needs a unit last stride"
    out, lse = TorchKernel().forward(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=causal, scale=scale
    )
    return out.transpose(0, 1).contiguous(), lse.float() if q.dtype != torch.float64 else lse


def _ref_bwd(dout, q, k, v, out, lse, dq, dk, dv, causal, scale):
    for x in (dout, q, k, v, out, dq, dk, dv):
        assert x.stride(-1) == 1
    assert lse.is_contiguous() and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    g = TorchKernel().backward(
        *(x.transpose(0, 1) for x in (dout, q, k, v, out)), lse, causal=causal, scale=scale
    )
    for buf, val in zip((dq, dk, dv), g):
        buf.copy_(val.transpose(0, 1))
    return torch.zeros_like(lse)  # softmax_d


def _v25():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size,
                            alibi_slopes, return_softmax):  # fmt: skip
        assert dropout_p == 0.0 and tuple(window_size) == (-1, -1)
        assert alibi_slopes is None and return_softmax is False
        out, lse = _ref_fwd(q, k, v, causal, softmax_scale)
        rng = torch.zeros(2, dtype=torch.int64)
        return out, q, k, v, out, lse, None, rng

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                             softmax_scale, causal, window_size, alibi_slopes, deterministic,
                             rng_state=None):  # fmt: skip
        assert tuple(window_size) == (-1, -1) and dropout_p == 0.0
        d = _ref_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale)
        return dq, dk, dv, d

    return types.SimpleNamespace(
        __version__="2.5.9",
        _flash_attn_forward=_flash_attn_forward,
        _flash_attn_backward=_flash_attn_backward,
    )


def _v26():
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, return_softmax):  # fmt: skip
        assert softcap == 0.0 and tuple(window_size) == (-1, -1)
        out, lse = _ref_fwd(q, k, v, causal, softmax_scale)
        return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes,
                             deterministic, rng_state=None):  # fmt: skip
        assert softcap == 0.0
        d = _ref_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale)
        return dq, dk, dv, d

    return types.SimpleNamespace(
        __version__="2.6.3",
        _flash_attn_forward=_flash_attn_forward,
        _flash_attn_backward=_flash_attn_backward,
    )


def _fwd27(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
           softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
           softcap: float, alibi_slopes: torch.Tensor | None, return_softmax: bool,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    assert (window_size_left, window_size_right) == (-1, -1) and softcap == 0.0
    out, lse = _ref_fwd(q, k, v, causal, softmax_scale)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _bwd27(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
           dk: torch.Tensor | None, dv: torch.Tensor | None, dropout_p: float,
           softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
           softcap: float, alibi_slopes: torch.Tensor | None, deterministic: bool,
           rng_state: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    return _ref_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale)


def _v27_plain():  # flash-attn 2.7+ under torch < 2.4: plain functions
    return types.SimpleNamespace(
        __version__="2.7.4", _flash_attn_forward=_fwd27, _flash_attn_backward=_bwd27
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
        _CUSTOM.update(__version__="2.8.3", _flash_attn_forward=fwd, _flash_attn_backward=bwd)
    return types.SimpleNamespace(**_CUSTOM)


FLASH_VERSIONS = {
    "2.5": _v25,
    "2.6": _v26,
    "2.7-plain": _v27_plain,
    "2.8-custom-op": _v27_custom_op,
}


@pytest.mark.parametrize("version", list(FLASH_VERSIONS))
def test_flash_attn_api_detection(version):
    api = bk.FlashAttnKernel(FLASH_VERSIONS[version]()).api
    assert api.split_window == (version not in ("2.5", "2.6"))
    assert api.lse_index == (1 if api.split_window else 5)
    assert ("softcap" in api.fwd_params) == (version != "2.5")


def test_custom_op_parameters_come_from_its_function_or_schema():
    ns = _v27_custom_op()
    op = ns._flash_attn_forward
    assert type(op).__name__ == "CustomOpDef"  # what flash-attn 2.7+ exposes
    names, required = bk._param_names(op)
    assert names[6:8] == ("window_size_left", "window_size_right")
    schema_names, _ = bk._param_names(torch.ops.startrail_test.flash_fwd)
    assert schema_names == names
    bwd_names, bwd_required = bk._param_names(torch.ops.startrail_test.flash_bwd.default)
    assert "rng_state" in bwd_names and "rng_state" not in bwd_required


@pytest.mark.parametrize("version", list(FLASH_VERSIONS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_flash_attn_adapter_computes_attention(version, causal, hq, hkv):
    ker = bk.FlashAttnKernel(FLASH_VERSIONS[version]())
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
    for got, w, x in zip(grads, want, (q, k, v)):
        assert got.shape == x.shape  # dk, dv keep the KV heads (GQA native)
        torch.testing.assert_close(got, w, rtol=0, atol=1e-12)


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
        bk.FlashAttnKernel(ns)
    ns26 = _v26()

    def fwd_new(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                return_softmax, sink_tokens):  # fmt: skip
        raise AssertionError("never called")

    ns26._flash_attn_forward = fwd_new
    with pytest.raises(NotImplementedError, match=r"parameters \['sink_tokens'\] this adapter"):
        bk.FlashAttnKernel(ns26).forward(*(torch.zeros(2, 1, 1, 8),) * 3, causal=False, scale=1.0)


# ---- PyTorch's CUDA SDPA ops, through their meta kernels -----------------------------------


@pytest.mark.parametrize(
    "cls", [bk.SdpaFlashKernel, bk.SdpaEfficientKernel, bk.SdpaCudnnKernel, st.kernels.SdpaKernel]
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
    for g, x in zip(grads, (q, k, k)):
        assert g.shape == x.shape and g.dtype == x.dtype
