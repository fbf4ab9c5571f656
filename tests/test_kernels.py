"""Single-process tests of the kernel contract, the merge, and the sequence helpers."""

from __future__ import annotations

import math

import pytest
import torch
from common import reference

import startrail_megatron as st
from startrail_megatron.kernels import SdpaKernel, TorchKernel, get_kernel, merge_partial


def _qkvd(sq, sk, hq, hkv, d=64, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, 2, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sk, 2, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sk, 2, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(sq, 2, hq, d, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, do)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_torch_kernel_is_exact(causal, hq, hkv):
    q, k, v, do = _qkvd(6, 6, hq, hkv)
    ker = TorchKernel()
    out, lse = ker.forward(q, k, v, causal=causal, scale=64**-0.5)
    ref = reference(q, k, v, do, causal)
    assert lse.shape == (2, hq, 6) and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref[0], rtol=0, atol=1e-12)
    grads = ker.backward(do, q, k, v, out, lse, causal=causal, scale=64**-0.5)
    assert len(grads) == 3
    for g, r in zip(grads, ref[1:]):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_sdpa_kernel_matches_reference(causal, hq, hkv, dtype, tol):
    q, k, v, do = _qkvd(8, 8 if causal else 5, hq, hkv, dtype=dtype)
    ref = reference(q, k, v, do, causal)
    ker = SdpaKernel()
    out, lse = ker.forward(q, k, v, causal=causal, scale=64**-0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_lse = TorchKernel().forward(
        q.double(), k.double(), v.double(), causal=causal, scale=64**-0.5
    )[1]
    assert (lse.double() - ref_lse).abs().max() <= tol
    assert (out.double() - ref[0]).abs().max() <= tol * ref[0].abs().max()
    grads = ker.backward(do, q, k, v, out, lse, causal=causal, scale=64**-0.5)
    assert len(grads) == 3
    for g, r in zip(grads, ref[1:]):
        assert g.dtype == dtype and g.shape == r.shape
        assert (g.double() - r).abs().max() <= tol * r.abs().max()


def test_get_kernel():
    assert get_kernel("auto", torch.float64).name == "torch"
    assert get_kernel("auto", torch.bfloat16).name == "sdpa"
    with pytest.raises(
        ValueError, match=r"kernel='flash' is not known; allowed: \['auto', 'torch'"
    ):
        get_kernel("flash")


def test_merge_equals_full_attention_and_never_nans():
    q, k, v, _ = _qkvd(6, 10, 4, 2)
    ker = TorchKernel()
    full_out, full_lse = ker.forward(q, k, v, causal=False, scale=0.1)
    acc_out = torch.zeros_like(q)
    acc_lse = torch.full((2, 4, 6), -math.inf, dtype=torch.float64)
    for sl in (slice(0, 3), slice(3, 10)):
        merge_partial(acc_out, acc_lse, *ker.forward(q, k[sl], v[sl], causal=False, scale=0.1))
    torch.testing.assert_close(acc_out, full_out, rtol=0, atol=1e-13)
    torch.testing.assert_close(acc_lse, full_lse, rtol=0, atol=1e-13)
    # merging "no key seen" (-inf) partials keeps zeros, not NaN
    z_out, z_lse = torch.zeros_like(q), torch.full((2, 4, 6), -math.inf, dtype=torch.float64)
    merge_partial(z_out, z_lse, torch.zeros_like(q), z_lse.clone())
    assert torch.isneginf(z_lse).all() and (z_out == 0).all()
    # a row that sees nothing (lse = -inf): zero gradients from that row, finite elsewhere
    out, lse = ker.forward(q, k, v, causal=False, scale=0.1)
    lse[:, :, 0] = -math.inf
    grads = ker.backward(torch.ones_like(q), q, k, v, out, lse, causal=False, scale=0.1)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][0] == 0).all()  # dq of the row
    dout = torch.ones_like(q)
    dout[0] = 0  # the row's dout removed: dk, dv must not change (the row contributes 0)
    out_ok, lse_ok = ker.forward(q, k, v, causal=False, scale=0.1)
    without = ker.backward(dout, q, k, v, out_ok, lse_ok, causal=False, scale=0.1)
    torch.testing.assert_close(grads[1], without[1], rtol=0, atol=1e-13)
    torch.testing.assert_close(grads[2], without[2], rtol=0, atol=1e-13)


def test_merge_in_lower_precision_casts_back():
    q, k, v, _ = _qkvd(4, 8, 4, 4, dtype=torch.bfloat16)
    acc_out = torch.zeros(4, 2, 4, 64)
    acc_lse = torch.full((2, 4, 4), -math.inf)
    out, lse = SdpaKernel().forward(q, k, v, causal=False, scale=0.125)
    merge_partial(acc_out, acc_lse, out, lse)
    assert acc_out.dtype == torch.float32 and torch.isfinite(acc_out).all()
    # the first merge into an empty accumulator is the partial itself, in fp32
    torch.testing.assert_close(acc_out, out.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(acc_lse, lse.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_zigzag_roundtrip(p):
    x = torch.arange(2 * p * 3 * 5).reshape(2 * p * 3, 5)
    shards = [st.zigzag_shard(x, r, p) for r in range(p)]
    assert all(s.shape == (6, 5) for s in shards)
    if p == 4:  # rank 1 holds chunks 1 and 6 of 8
        assert shards[1][:, 0].tolist() == [15, 20, 25, 90, 95, 100]
    torch.testing.assert_close(st.zigzag_unshard(shards), x)
    y = x.T.contiguous()
    torch.testing.assert_close(
        st.zigzag_unshard([st.zigzag_shard(y, r, p, dim=1) for r in range(p)], dim=1), y
    )


def test_zigzag_errors():
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size = 8"):
        st.zigzag_shard(torch.zeros(12), 0, 4)
    with pytest.raises(ValueError, match="cp_rank=4"):
        st.zigzag_shard(torch.zeros(16), 4, 4)
    with pytest.raises(ValueError, match="same even length"):
        st.zigzag_unshard([torch.zeros(4), torch.zeros(6)])
