"""Attention dropout under StarTrail (core and kernels).

Exact: every kernel call's mask is rebuilt from the RNG state its ``Dropout`` record saved
(``kernels.dropout_keep``), placed at the call's global (query, key) positions, and a
float64 dense attention with that one global mask gives the same out, dq, dk, dv (1e-10) on
several ranks and layouts (gloo and one process), dense and packed. That check fails
if the masks are not used (the outputs then differ from the no-dropout ones by far more);
the saved states are replayed, so the backward must rebuild the forward's masks.
Statistical: over many draws the kept fraction is 1 - p and the mean output is attention
without dropout, as for one-device dropout. ``dropout_p=0`` is bitwise the code without
dropout. Kernels: the reference, flash-attn's dense and varlen stand-ins, SDPA's CUDA ops on
meta tensors; kernels without dropout are refused by name before any transfer.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from common import groups_for, rel_err, value_errors
from harness import run_ranks
from test_backends import FLASH_VERSIONS

import startrail_megatron as st
from startrail_megatron import kernels as kn
from startrail_megatron.kernels import Dropout, TorchKernel, dropout_keep
from startrail_megatron.one_process import one_process_attention
from startrail_megatron.rank import TeamOrder
from startrail_megatron.schedule import startrail_step_rows
from startrail_megatron.schedule.packing import pack_lengths

B, HQ, HKV, D = 2, 4, 2, 8
P_DROP = 0.3


class Recording:
    """A kernel that records each forward call's ``Dropout`` record and its q and k shapes,
    in call order (``backward_records``, ``backward_shapes``: the same of the backward)."""

    name = "recording"
    supports_dropout = True

    def __init__(self, inner=None):
        self.inner = inner or TorchKernel()
        self.records: list = []
        self.shapes: list = []
        self.backward_records: list = []
        self.backward_shapes: list = []

    def forward(self, q, k, v, **kw):
        self.records.append(kw.get("dropout"))
        self.shapes.append((q.shape, k.shape))
        return self.inner.forward(q, k, v, **kw)

    def backward(self, dout, q, k, *a, **kw):
        self.backward_records.append(kw.get("dropout"))
        self.backward_shapes.append((q.shape, k.shape))
        return self.inner.backward(dout, q, k, *a, **kw)


def _team_positions(lay, team, causal, s_local, packed, local_pos):
    """Global token position of every row of a team's buffer (-1: padding)."""
    order = TeamOrder(lay, team, 0, causal, packed)
    gathered = torch.cat([local_pos[m] for m in lay.team_ranks(team)])
    return order.to_team(gathered)


def global_mask(lay, causal, s_local, packed, records_by_rank, b, hq, hkv, total):
    """The [b, hq, S, S] keep mask (1 / (1 - p) scaled) StarTrail's calls applied."""
    p = lay.cp_size
    ids = torch.arange(total)
    if packed is None:
        local = [st.testing.shard(ids, r, p, causal) for r in range(p)]
    else:
        local = [st.shard_packed(ids, packed, r) for r in range(p)]
        for r in range(p):  # padding rows: shard_packed fills 0; mark them -1
            pad = torch.ones(packed.s_local, dtype=torch.bool)
            for _, dst, n in packed.local_rows(r):
                pad[dst : dst + n] = False
            local[r] = torch.where(pad, -1, local[r])
    pos = [_team_positions(lay, t, causal, s_local, packed, local) for t in range(lay.num_teams)]
    mask = torch.full((b, hq, total, total), float("nan"), dtype=torch.float64)
    g = hq // hkv
    for r in range(p):
        recs = iter(records_by_rank[r])
        team = lay.coord(r)[0]
        for step in range(lay.ring_size):
            kv_team = lay.kv_team_at_step(r, step)
            for call in startrail_step_rows(lay, r, step, causal, s_local, packed):
                ql, qh, kl, kh, cz = call.q_lo, call.q_hi, call.kv_lo, call.kv_hi, call.causal
                rec = next(recs)
                nq, nk = qh - ql, kh - kl
                keep = dropout_keep(Dropout(rec.p, state=rec.state), (b, hkv, g, nq, nk), "cpu")
                keep = keep.reshape(b, hq, nq, nk).double() / (1 - rec.p)
                qp, kp = pos[team][ql:qh], pos[kv_team][kl:kh]
                assert (qp >= 0).all() and (kp >= 0).all()
                if cz:  # the causal call's masked upper triangle is no pair of the sequence
                    keep = keep.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(1), 0)
                    block = mask[:, :, qp[:, None], kp[None, :]]
                    keep = torch.where(torch.ones(nq, nk, dtype=torch.bool).triu(1), block, keep)
                mask[:, :, qp[:, None], kp[None, :]] = keep
        assert next(recs, None) is None, "more kernel calls than the block plan"
    return mask


def masked_reference(q, k, v, do, mask, causal, doc_ids=None):
    """float64 dense attention with dropout mask ``mask`` [b, hq, S, S] applied to the
    probabilities; -> out, dq, dk, dv in [S, b, h, d]."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    qq, kk, vv = (x.permute(1, 2, 0, 3) for x in leaves)
    g = qq.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
    s = qq @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None] == doc_ids[None, :])
    s = s.masked_fill(~allowed, float("-inf"))
    prob = torch.softmax(s, -1).nan_to_num(0.0)
    used = torch.where(allowed, mask, torch.zeros_like(mask))
    assert not used.isnan().any(), "a needed pair no call computed"
    out = ((prob * used) @ vv).permute(2, 0, 1, 3)
    out.backward(do.double())
    return [out.detach(), *(x.grad for x in leaves)]


def _inputs(total, b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(total, b, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)
    ]


# ---- the reference kernel ------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_dropout_matches_autograd(causal):
    q, k, v, do = _inputs(6, b=2)
    rec = Dropout(P_DROP, generator=torch.Generator().manual_seed(3))
    ker = TorchKernel()
    out, lse = ker.forward(q, k, v, causal=causal, scale=0.5, dropout=rec)
    plain, plain_lse = ker.forward(q, k, v, causal=causal, scale=0.5)
    assert torch.equal(lse, plain_lse)  # statistics before dropout
    keep = dropout_keep(Dropout(P_DROP, state=rec.state), (2, HKV, HQ // HKV, 6, 6), "cpu")
    mask = keep.reshape(2, HQ, 6, 6).double() / (1 - P_DROP)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    qq, kk, vv = (x.permute(1, 2, 0, 3) for x in leaves)
    kk, vv = kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1)
    s = qq @ kk.transpose(-1, -2) * 0.5
    if causal:
        s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    ref = ((torch.softmax(s, -1) * mask) @ vv).permute(2, 0, 1, 3)
    ref.backward(do)
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-12)
    assert rel_err(out, plain) > 0.1  # dropout did something
    grads = ker.backward(do, q, k, v, out, lse, causal=causal, scale=0.5, dropout=rec)
    for gx, x in zip(grads, leaves):
        torch.testing.assert_close(gx, x.grad, rtol=0, atol=1e-12)


# ---- StarTrail: exact against the rebuilt global mask -------------------------------------
def _kernel(name):
    if name == "torch":
        return Recording()
    return Recording(kn.FlashAttnKernel(FLASH_VERSIONS[name.split(":")[1]]()))


def _startrail_case(rank, world, c, placement, causal, lengths, seed, kernel="torch"):
    torch.manual_seed(seed + rank)  # each rank's default generator: where the masks come from
    total = world * 12 if lengths is None else sum(lengths)
    packed = None if lengths is None else pack_lengths(lengths, world)
    q, k, v, do = _inputs(total)

    def local(x):
        return (
            st.testing.shard(x, rank, world, causal)
            if packed is None
            else st.shard_packed(x, packed, rank)
        )

    leaves = [local(x).requires_grad_() for x in (q, k, v)]
    ker = _kernel(kernel)
    kw = {} if packed is None else dict(cu_seqlens=packed.cu_seqlens)
    if packed is not None:
        kw["cu_seqlens_padded"] = packed.cu_seqlens_padded
    out = st.startrail_attention(
        *leaves, groups_for(c, placement), causal=causal, kernel=ker, dropout_p=P_DROP, **kw
    )
    out.backward(local(do))
    records = [Dropout(r.p, state=r.state) for r in ker.records]
    return [out.detach(), *(x.grad for x in leaves)], records


def _check(results, p, c, placement, causal, lengths, tol=1e-10):
    lay = st.StarTrailLayout(p, c, placement)
    total = p * 12 if lengths is None else sum(lengths)
    packed = None if lengths is None else pack_lengths(lengths, p)
    s_local = total // p if packed is None else packed.s_local
    q, k, v, do = _inputs(total)
    mask = global_mask(lay, causal, s_local, packed, [r[1] for r in results], B, HQ, HKV, total)
    docs = None
    if lengths is not None:
        docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ref = masked_reference(q, k, v, do, mask, causal, docs)
    plain = st.testing.reference_attention(q, k, v, do, causal) if lengths is None else None
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        parts = [r[0][i] for r in results]
        got = (
            st.testing.unshard(parts, causal)
            if packed is None
            else st.unshard_packed(parts, packed)
        )
        assert rel_err(got, ref[i]) <= tol, what
        if plain is not None:  # the masks mattered: far from attention without dropout
            assert rel_err(got, plain[i]) > 0.05, what


@pytest.mark.parametrize(
    "p, c, placement, causal, lengths",
    [
        (4, 2, "team", True, None),
        (4, 1, "team", False, None),
        (8, 2, "ring", True, None),
        (9, 3, "team", True, None),
        (16, 4, "team", True, None),
        (4, 2, "team", True, [17, 0, 30, 5]),
    ],
)
def test_startrail_dropout_is_exact_against_the_rebuilt_masks(p, c, placement, causal, lengths):
    results = run_ranks(p, _startrail_case, c, placement, causal, lengths, 11)
    _check(results, p, c, placement, causal, lengths)


@pytest.mark.parametrize("version", ["2.5", "2.7-plain", "2.8-custom-op"])
def test_startrail_dropout_on_flash_attn_is_exact(version):
    """flash-attn (stand-ins with each release's signature, their dropout drawn from the
    default generator like flash-attn's from the CUDA one): the rng_state each forward
    returned rebuilds its mask in the backward and in the reference."""
    results = run_ranks(4, _startrail_case, 2, "team", True, None, 3, f"flash:{version}")
    _check(results, 4, 2, "team", True, None, tol=1e-6)  # flash's lse is fp32


# ---- one mask per kernel call ----------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_each_kernel_call_draws_its_own_mask_and_its_backward_reuses_it(causal):
    """P = 4, C = 1 in one process (16 or 22 kernel calls, 4 or more per rank of one shape):
    the masks rebuilt from the records' saved RNG states differ between any two forward calls
    of one shape (p = 0.3 over 144 or more entries: equal by chance with probability below
    1e-30), and the backward calls rebuild exactly the forward calls' masks, one each."""
    p, total = 4, 24 if not causal else 48
    torch.manual_seed(5)
    q, k, v, do = _inputs(total, b=1)
    shards = [
        [st.testing.shard(x, r, p, causal).requires_grad_() for r in range(p)] for x in (q, k, v)
    ]
    ker = Recording()
    outs = one_process_attention(*shards, 1, kernel=ker, dropout_p=P_DROP, causal=causal)
    torch.autograd.backward(outs, [st.testing.shard(do, r, p, causal) for r in range(p)])

    def masks(records, shapes):
        """(sq, sk, mask bytes) of each call, the mask rebuilt from the record's state."""
        got = []
        for rec, (qs, ks) in zip(records, shapes, strict=True):
            shape = (1, HKV, HQ // HKV, qs[0], ks[0])
            keep = dropout_keep(Dropout(rec.p, state=rec.state), shape, "cpu")
            got.append((qs[0], ks[0], keep.numpy().tobytes()))
        return got

    fwd = masks(ker.records, ker.shapes)
    bwd = masks(ker.backward_records, ker.backward_shapes)
    assert len(fwd) >= 16 and max(Counter(m[:2] for m in fwd).values()) >= 4
    assert len(set(fwd)) == len(fwd), "two kernel calls drew the same dropout mask"
    assert sorted(bwd) == sorted(fwd), "a backward call's mask is not its forward call's"


# ---- statistics ----------------------------------------------------------------------------
def test_kept_fraction_and_mean_output_match_one_device_dropout():
    """Over 300 draws (P = 4, C = 2, one process): the kept fraction is 1 - p within 4
    standard errors, and the mean output approaches attention without dropout as closely
    as one-device dropout of the probabilities does (same draws)."""
    p, c, n_draws, total = 4, 2, 300, 48
    torch.manual_seed(0)
    q, k, v, _ = _inputs(total, b=1)
    shards = [[st.testing.shard(x, r, p, True) for r in range(p)] for x in (q, k, v)]
    plain = st.testing.reference_attention(q, k, v, torch.zeros_like(q), True)[0]
    acc = torch.zeros_like(q)
    kept = seen = 0
    for _ in range(n_draws):
        ker = Recording()
        outs = one_process_attention(*shards, c, kernel=ker, dropout_p=P_DROP)
        acc += st.testing.unshard(outs, True)
        for rec, (qs, ks) in zip(ker.records, ker.shapes):
            m = dropout_keep(
                Dropout(rec.p, state=rec.state), (1, HKV, HQ // HKV, qs[0], ks[0]), "cpu"
            )
            kept, seen = kept + int(m.sum()), seen + m.numel()
    frac, se = kept / seen, (P_DROP * (1 - P_DROP) / seen) ** 0.5
    assert abs(frac - (1 - P_DROP)) < 4 * se, (frac, se)
    one = torch.zeros_like(q)
    qq, kk, vv = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    kk, vv = kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1)
    s = (qq @ kk.transpose(-1, -2) * D**-0.5).masked_fill(
        torch.ones(total, total, dtype=torch.bool).triu(1), float("-inf")
    )
    for _ in range(n_draws):
        prob = torch.nn.functional.dropout(torch.softmax(s, -1), P_DROP)
        one += (prob @ vv).permute(2, 0, 1, 3)
    err, err_one = rel_err(acc / n_draws, plain), rel_err(one / n_draws, plain)
    assert err < 0.1 and err < 2 * err_one + 0.01, (err, err_one)


# ---- p = 0, evaluation, refusals -----------------------------------------------------------
def _zero_case(rank, world):
    q, k, v, do = _inputs(world * 12)
    outs = []
    for kw in ({}, {"dropout_p": 0.0}, {"dropout_p": 0}):
        leaves = [st.testing.shard(x, rank, world, True).requires_grad_() for x in (q, k, v)]
        ker = Recording()
        out = st.startrail_attention(*leaves, groups_for(2), kernel=ker, **kw)
        out.backward(st.testing.shard(do, rank, world, True))
        assert all(r is None for r in ker.records)  # no Dropout record reaches a kernel
        outs.append([out.detach(), *(x.grad for x in leaves)])
    return outs


def test_dropout_zero_is_bitwise_the_code_without_dropout():
    for outs in run_ranks(4, _zero_case):
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b)


def _refusals(rank, world):
    x = torch.randn(8, 1, 2, D, dtype=torch.float32)
    groups = groups_for(2)
    ledger = st.CommLedger()

    def call(**kw):
        return lambda: st.startrail_attention(x, x, x, groups, ledger=ledger, **kw)

    msgs = value_errors(
        {
            "negative": call(dropout_p=-0.1),
            "one": call(dropout_p=1.0),
            "nan": call(dropout_p=float("nan")),
            "bool": call(dropout_p=True),
            # ranks that disagree on dropout_p: all raise, none hang
            "ranks": call(dropout_p=0.1 * (rank % 2)),
        }
    )
    msgs.update(value_errors({"sdpa": call(kernel="sdpa", dropout_p=0.1)}, NotImplementedError))
    return msgs, len(ledger.events)


def test_bad_dropout_is_refused_before_any_transfer():
    for msgs, sent in run_ranks(4, _refusals):
        for name in ("negative", "one", "nan", "bool"):
            assert "dropout_p=" in msgs[name] and "0 <= dropout_p < 1" in msgs[name], name
        assert (
            "kernel='sdpa' cannot run these inputs: does not run attention dropout"
            in (msgs["sdpa"])
        )
        assert msgs["ranks"] is not None and "disagree on dropout_p" in msgs["ranks"]
        assert sent == 0


def test_auto_picks_a_kernel_with_dropout():
    assert st.get_kernel("auto", torch.float32).name == "sdpa"
    assert st.get_kernel("auto", torch.float32, dropout=True).name == "torch"
    cuda = dict(device_type="cuda", capability=(9, 0), cudnn_version=90100)
    q = kn.KernelQuery(dtype=torch.bfloat16, head_dim=128, dropout=True, **cuda)
    assert kn.choose_kernel("auto", q, lambda m: False, {})[0] == "sdpa_flash"
    with pytest.raises(NotImplementedError, match="'te' cannot run these inputs: does not run"):
        kn.choose_kernel("te", q, lambda m: True, {})


# ---- flash-attn stand-ins: the adapter passes dropout_p and hands rng_state back ------------
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("version", list(FLASH_VERSIONS))
def test_flash_attn_dropout_passes_its_rng_state(version, varlen):
    ns = FLASH_VERSIONS[version]()
    seen = {}
    names = ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward") if varlen else (
        "_flash_attn_forward", "_flash_attn_backward"
    )  # fmt: skip
    fwd, bwd = (getattr(ns, n) for n in names)

    def fwd_spy(**kw):
        seen["fwd_p"] = kw["dropout_p"]
        kw = dict(kw, dropout_p=0.0)  # the stand-in computes without dropout
        res = list(fwd(**kw))
        res[3 if len(res) == 4 else 7] = torch.tensor([123, 456])  # flash's (seed, offset)
        return tuple(res)

    def bwd_spy(**kw):
        seen["bwd_p"], seen["rng"] = kw["dropout_p"], kw["rng_state"]
        return bwd(**dict(kw, dropout_p=0.0))

    fwd_spy._init_fn = getattr(fwd, "_init_fn", fwd)
    bwd_spy._init_fn = getattr(bwd, "_init_fn", bwd)
    setattr(ns, names[0], fwd_spy)
    setattr(ns, names[1], bwd_spy)
    ker = kn.FlashAttnKernel(ns)
    rec = Dropout(0.25)
    if varlen:
        x = torch.randn(6, 2, 16, dtype=torch.float64)
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        out, lse = ker.forward_varlen(x, x, x, cu, cu, 4, 4, causal=True, scale=0.3, dropout=rec)
    else:
        x = torch.randn(6, 1, 2, 16, dtype=torch.float64)
        out, lse = ker.forward(x, x, x, causal=True, scale=0.3, dropout=rec)
    assert seen["fwd_p"] == 0.25 and torch.equal(rec.state, torch.tensor([123, 456]))
    if varlen:
        ker.backward_varlen(x, x, x, x, out, lse, cu, cu, 4, 4, causal=True, scale=0.3, dropout=rec)
    else:
        ker.backward(x, x, x, x, out, lse, causal=True, scale=0.3, dropout=rec)
    assert seen["bwd_p"] == 0.25 and seen["rng"] is rec.state
    with pytest.raises(NotImplementedError, match="takes no generator"):
        y = torch.randn(6, 1, 2, 16, dtype=torch.float64)
        ker.forward(y, y, y, causal=True, scale=0.3, dropout=Dropout(0.1, torch.Generator()))


@pytest.mark.parametrize("cls", [kn.SdpaFlashKernel, kn.SdpaEfficientKernel, kn.SdpaCudnnKernel])
def test_sdpa_cuda_ops_dropout_wiring_on_meta(cls):
    """The CUDA ops' meta kernels check the argument order: dropout_p in, the Philox seed and
    offset kept by the record and handed to the backward."""
    q = torch.empty(16, 2, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(16, 2, 4, 64, device="meta", dtype=torch.bfloat16)
    rec = Dropout(0.1)
    out, lse = cls().forward(q, k, k, causal=True, scale=0.125, dropout=rec)
    assert out.shape == q.shape and isinstance(rec.state, tuple) and len(rec.state) == 2
    grads = cls().backward(q, q, k, k, out, lse, causal=True, scale=0.125, dropout=rec)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
