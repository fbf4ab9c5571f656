"""Packed documents on variable-length kernels: flash-attn's varlen functions and
Transformer Engine's THD format, through stand-ins with each release's exact signatures
(``test_backends.py``), since neither runs on CPU.

Adapters: THD out, lse and dq, dk, dv against float64 attention per sequence (GQA, a length-1
sequence, q and k of different lengths without the mask), for every generation's lse form
(flash-attn 2.5's padded [n, h, max_q] and 2.6+'s [h, t]; TE's [n, h, max_q, 1], bucketed
[rows >= t, h, 1] and exact [t, h, 1]). StarTrail: packed documents on those kernels against
float64 per document (padding rows, random in the inputs, exactly zero in out, dq, dk, dv),
one process (P = 4 - 16) and gloo ranks, proving the grouped calls ran:
every kernel call is a varlen/THD call, one per call of the team block plan (fewer than the
per-document calls), and none of the dense functions is called.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from common import (
    assert_padding_rows_zero,
    noisy_packed_shards,
    packed_inputs,
    packed_reference,
    reference_per_document,
    rel_err,
)
from harness import run_ranks
from test_backends import FLASH_VERSIONS, TE_VERSIONS, _te_stand_in

import startrail_megatron as st
from startrail_megatron import kernels as kn
from startrail_megatron.kernels import TorchKernel
from startrail_megatron.kernels import te as kn_te
from startrail_megatron.one_process import one_process_attention
from startrail_megatron.schedule import (
    startrail_step_rows,
    startrail_step_varlen,
    tail_head_groups,
)
from startrail_megatron.schedule.packing import pack_lengths


class _Counting:
    """Wraps a stand-in module's functions to count the calls of each."""

    def __init__(self, ns, names):
        self.counts = dict.fromkeys(names, 0)
        for n in names:
            setattr(self, n, self._wrap(n, getattr(ns, n)))
        self.__version__ = getattr(ns, "__version__", "?")

    def _wrap(self, name, fn):
        def call(*a, **kw):
            self.counts[name] += 1
            return fn(*a, **kw)

        call._init_fn = getattr(fn, "_init_fn", None) or fn  # signatures are read from it
        return call


_FLASH_FNS = (
    "_flash_attn_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward",
)


def _flash_kernel(version):
    ns = _Counting(FLASH_VERSIONS[version](), _FLASH_FNS)
    return kn.FlashAttnKernel(ns), ns.counts


class _CpuTE:
    """TEKernel on the CPU stand-in: widens the devices and dtypes it accepts while in use
    (restored after: workers are reused across tests)."""

    def __enter__(self):
        self.saved = spec = kn_te.TEKernel.spec
        wide = dict(devices=frozenset({"cuda", "cpu"}), dtypes=spec.dtypes | {torch.float64})
        kn_te.TEKernel.spec = dataclasses.replace(spec, **wide)

    def __exit__(self, *exc):
        kn_te.TEKernel.spec = self.saved


def _te_kernel(version, thd=True):
    te = _te_stand_in(TE_VERSIONS[version])
    ker = kn.TEKernel(te.fused_attn, te_dtype=te.TE_DType, version=te.version, thd=thd)
    return ker, te.calls


def _thd(lens, h, d, g):
    return torch.randn(sum(lens), h, d, generator=g, dtype=torch.float64)


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _per_sequence(kernel_fn, lens_q, lens_k, *tensors):
    """Run the reference per sequence on THD slices (q-side tensors first, then k, v)."""
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    return [
        kernel_fn(i, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(lens_q))
    ]


def _check_varlen_adapter(ker, causal, hq, hkv):
    g = torch.Generator().manual_seed(5)
    lens_q = [5, 1, 9, 3]
    lens_k = lens_q if causal else [2, 7, 9, 1]
    d, scale = 16, 0.3
    q, do = _thd(lens_q, hq, d, g), _thd(lens_q, hq, d, g)
    k, v = _thd(lens_k, hkv, d, g), _thd(lens_k, hkv, d, g)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    ref = TorchKernel()

    def one(i, qs, ks):
        return ref.forward(q[qs, None], k[ks, None], v[ks, None], causal=causal, scale=scale)

    pieces = _per_sequence(one, lens_q, lens_k)
    r_out = torch.cat([o[:, 0] for o, _ in pieces])
    r_lse = torch.cat([lse[0] for _, lse in pieces], dim=1)  # [hq, t]
    out, lse = ker.forward_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, scale=scale
    )
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    torch.testing.assert_close(out, r_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse.double(), r_lse, rtol=0, atol=1e-6)

    def grads(i, qs, ks):
        return ref.backward(
            do[qs, None], q[qs, None], k[ks, None], v[ks, None], r_out[qs, None],
            r_lse[None, :, qs], causal=causal, scale=scale,
        )  # fmt: skip

    want = [torch.cat([p[j][:, 0] for p in _per_sequence(grads, lens_q, lens_k)]) for j in range(3)]
    got = ker.backward_varlen(
        do, q, k, v, r_out, r_lse.float() if ker.name == "flash_attn" else r_lse, cu_q, cu_k,
        max(lens_q), max(lens_k), causal=causal, scale=scale,
    )  # fmt: skip
    for gx, w, x in zip(got, want, (q, k, v)):
        assert gx.shape == x.shape  # dk, dv keep the KV heads (GQA)
        torch.testing.assert_close(gx.double(), w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("version", list(FLASH_VERSIONS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_flash_attn_varlen_adapter(version, causal, hq, hkv):
    ker, counts = _flash_kernel(version)
    assert kn.has_varlen(ker)
    assert ker.varlen_api.padded_varlen_lse == (version == "2.5")
    _check_varlen_adapter(ker, causal, hq, hkv)
    assert counts["_flash_attn_varlen_forward"] == 1 and counts["_flash_attn_varlen_backward"] == 1


def test_flash_attn_varlen_signature_it_cannot_read_leaves_the_dense_kernel():
    ns = FLASH_VERSIONS["2.6"]()

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, softmax_scale, causal):  # fmt: skip
        raise AssertionError("never called")

    ns._flash_attn_varlen_forward = _flash_attn_varlen_forward
    ker = kn.FlashAttnKernel(ns)
    assert not kn.has_varlen(ker) and "neither window_size" in ker.varlen_unavailable_reason
    x = torch.randn(4, 1, 2, 8, dtype=torch.float64)
    out, _ = ker.forward(x, x, x, causal=True, scale=1.0)  # the dense functions still work
    torch.testing.assert_close(out, TorchKernel().forward(x, x, x, causal=True, scale=1.0)[0])


def test_te_thd_needs_sm90_and_cudnn_9_6():
    assert kn_te.te_thd_unsupported_reason((9, 0), 90600) is None
    assert kn_te.te_thd_unsupported_reason((10, 0), 91000) is None
    assert "compute capability" in kn_te.te_thd_unsupported_reason((8, 0), 91000)
    assert "cuDNN >= 90600" in kn_te.te_thd_unsupported_reason((9, 0), 90500)
    assert "compute capability" in kn_te.te_thd_unsupported_reason(None, None)
    te = _te_stand_in(TE_VERSIONS["2.18"])
    ker = kn.TEKernel(te.fused_attn, te_dtype=te.TE_DType, version=te.version)
    assert ker.varlen_available == (
        torch.cuda.is_available()
        and kn_te.te_thd_unsupported_reason(
            torch.cuda.get_device_capability(), torch.backends.cudnn.version()
        )
        is None
    )


def test_te_thd_stats_rows():
    assert [kn_te.te_max_tokens(t) for t in (1, 1024, 1025, 4097, 32768, 32769, 70000)] == [
        1024, 1024, 2048, 8192, 32768, 65536, 98304,
    ]  # fmt: skip
    with _CpuTE():
        ker, _ = _te_kernel("2.18")
        cu = torch.tensor([0, 5], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="statistics of 1500 rows for 5 tokens"):
            ker._thd_stats_to_packed(torch.zeros(1500, 2, 1), cu, 5, 2, torch.bfloat16)
        with pytest.raises(RuntimeError, match="statistics of shape"):
            ker._thd_stats_to_packed(torch.zeros(2, 5, 1), cu, 5, 2, torch.bfloat16)


@pytest.mark.parametrize("version", list(TE_VERSIONS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_te_thd_adapter(version, causal, hq, hkv):
    with _CpuTE():
        ker, calls = _te_kernel(version)
        assert kn.has_varlen(ker)
        _check_varlen_adapter(ker, causal, hq, hkv)
    fwd, bwd = calls[0][1], calls[1][1]
    assert [c[0] for c in calls] == ["fwd", "bwd"]
    for a in (fwd, bwd):
        assert a["qkv_layout"] == "thd_thd_thd"
        assert a["attn_mask_type"] == ("padding_causal" if causal else "padding")
        assert a["cu_seqlens_q"].dtype == torch.int32


# ---- StarTrail on the varlen kernels -------------------------------------------------------
B, HQ, HKV, D = 2, 4, 2, 16
LENGTHS = [17, 0, 31, 1, 11, 64]


def _packed_inputs(lengths, b, seed=3):
    return packed_inputs(lengths, b, HQ, HKV, D, seed)


def _expected_calls(p, c, placement, causal, packed, ranks=None):
    """Kernel calls of the block plan over ``ranks`` (all by default): (grouped forward,
    grouped backward, per-document forward, per-document backward). The last sub-ring step
    runs once per head group (``tail_head_groups``), forward and backward."""
    lay = st.StarTrailLayout(p, c, placement)
    tail = len(tail_head_groups(lay, HQ, HKV, False))
    counts = [0, 0, 0, 0]
    for r in range(p) if ranks is None else ranks:
        for step in range(lay.ring_size):
            times = tail if step == lay.ring_size - 1 else 1
            grouped = len(startrail_step_varlen(lay, r, step, causal, packed))
            per_doc = len(startrail_step_rows(lay, r, step, causal, packed.s_local, packed))
            for i, n in enumerate((grouped, grouped, per_doc, per_doc)):
                counts[i] += n * times
    return tuple(counts)


@pytest.mark.parametrize(
    "kernel, p, c, placement, causal",
    [
        ("flash:2.5", 4, 2, "team", True),
        ("flash:2.6", 8, 2, "ring", True),
        ("flash:2.8-custom-op", 9, 3, "team", False),
        ("te:1.12", 4, 1, "team", True),
        ("te:2.4", 16, 4, "team", True),
        ("te:2.18", 16, 2, "ring", False),
    ],
)
def test_startrail_packed_on_varlen_kernels(kernel, p, c, placement, causal):
    family, version = kernel.split(":")
    packed = pack_lengths(LENGTHS, p)
    q, k, v, do = _packed_inputs(LENGTHS, B)
    shards = [noisy_packed_shards((q, k, v, do), LENGTHS, p, r) for r in range(p)]
    leaves = [[shards[r][i].requires_grad_() for r in range(p)] for i in range(3)]
    with _CpuTE():
        if family == "flash":
            ker, counts = _flash_kernel(version)
        else:
            ker, calls = _te_kernel(version)
        outs = one_process_attention(
            *leaves, c, placement=placement, causal=causal, kernel=ker,
            cu_seqlens=packed.cu_seqlens, cu_seqlens_padded=packed.cu_seqlens_padded,
        )  # fmt: skip
        torch.autograd.backward(outs, [shards[r][3] for r in range(p)])
    ref = [torch.cat(x, dim=1) for x in zip(*(
        reference_per_document(LENGTHS, causal, *(t[:, i : i + 1] for t in (q, k, v, do)))
        for i in range(B)
    ))]  # fmt: skip
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    assert_padding_rows_zero([[t[r].detach() for t in got] for r in range(p)], LENGTHS, p)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        full = st.unshard_packed([t.detach() for t in got[i]], packed)
        assert rel_err(full, ref[i]) <= 1e-10, what
    # the grouped calls ran: one varlen call per call of the block plan, nothing dense
    g_fwd, g_bwd, d_fwd, _ = _expected_calls(p, c, placement, causal, packed)
    assert g_fwd < d_fwd
    if family == "flash":
        assert counts == {
            "_flash_attn_forward": 0,
            "_flash_attn_backward": 0,
            "_flash_attn_varlen_forward": g_fwd,
            "_flash_attn_varlen_backward": g_bwd,
        }
    else:
        assert [c[0] for c in calls].count("fwd") == g_fwd
        assert [c[0] for c in calls].count("bwd") == g_bwd
        assert all(a["qkv_layout"] == "thd_thd_thd" for _, a in calls)


def _multi_rank_case(rank, world, kernel, c, lengths):
    family, version = kernel.split(":")
    packed = pack_lengths(lengths, world)
    *local, d_out = noisy_packed_shards(_packed_inputs(lengths, 1), lengths, world, rank)
    local = [x.requires_grad_() for x in local]
    from common import groups_for

    with _CpuTE():
        ker, log = _flash_kernel(version) if family == "flash" else _te_kernel(version)
        out = st.startrail_attention(
            *local, groups_for(c, "team"), causal=True, kernel=ker,
            cu_seqlens=packed.cu_seqlens, cu_seqlens_padded=packed.cu_seqlens_padded,
        )  # fmt: skip
        out.backward(d_out)
    if family == "flash":
        n_calls = (log["_flash_attn_varlen_forward"], log["_flash_attn_varlen_backward"])
    else:
        n_calls = tuple(sum(1 for kind, _ in log if kind == x) for x in ("fwd", "bwd"))
    return [out.detach(), *(x.grad for x in local)], n_calls


@pytest.mark.parametrize("kernel", ["flash:2.7-plain", "te:2.13"])
def test_startrail_packed_varlen_on_ranks(kernel):
    p, c, lengths = 4, 2, [2039, 1013, 509, 3]
    results = run_ranks(p, _multi_rank_case, kernel, c, lengths)
    packed = pack_lengths(lengths, p)
    ref = packed_reference(tuple(lengths), True, 1, HQ, HKV, D, seed=3)  # _packed_inputs(.., 1)
    assert_padding_rows_zero([res[0] for res in results], lengths, p)
    for i in range(4):
        got = st.unshard_packed([res[0][i] for res in results], packed)
        assert rel_err(got, ref[i]) <= 1e-10
    for r, (_, n_calls) in enumerate(results):
        assert n_calls == _expected_calls(p, c, "team", True, packed, [r])[:2]


@pytest.mark.parametrize("kernel", ["flash:no-varlen", "te:no-thd"])
def test_packed_falls_back_to_one_call_per_document(kernel):
    """flash-attn without (readable) varlen functions, TE where THD cannot run: the same
    exact result from one dense call per document and block, and no varlen/THD call."""
    p, c, causal = 4, 2, True
    packed = pack_lengths(LENGTHS, p)
    q, k, v, do = _packed_inputs(LENGTHS, 1)
    shards = [noisy_packed_shards((q, k, v, do), LENGTHS, p, r) for r in range(p)]
    leaves = [[shards[r][i].requires_grad_() for r in range(p)] for i in range(3)]
    with _CpuTE():
        if kernel.startswith("flash"):
            ns = FLASH_VERSIONS["2.8-custom-op"]()
            counting = _Counting(ns, _FLASH_FNS[:2])
            ker = kn.FlashAttnKernel(counting)
            assert not kn.has_varlen(ker)
        else:
            ker, calls = _te_kernel("2.18", thd=False)
        outs = one_process_attention(
            *leaves, c, causal=causal, kernel=ker,
            cu_seqlens=packed.cu_seqlens, cu_seqlens_padded=packed.cu_seqlens_padded,
        )  # fmt: skip
        torch.autograd.backward(outs, [shards[r][3] for r in range(p)])
    ref = packed_reference(tuple(LENGTHS), causal, 1, HQ, HKV, D, seed=3)  # q, k, v, do
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    assert_padding_rows_zero([[t[r].detach() for t in got] for r in range(p)], LENGTHS, p)
    tol = 1e-6 if kernel.startswith("flash") else 1e-10  # the dense adapter's lse is fp32
    for i in range(4):
        assert rel_err(st.unshard_packed([t.detach() for t in got[i]], packed), ref[i]) <= tol
    _, _, d_fwd, d_bwd = _expected_calls(p, c, "team", causal, packed)
    if kernel.startswith("flash"):
        assert counting.counts == {"_flash_attn_forward": d_fwd, "_flash_attn_backward": d_bwd}
    else:
        assert len(calls) == d_fwd + d_bwd
        assert all(a["qkv_layout"] == "sbhd_sbhd_sbhd" for _, a in calls)
