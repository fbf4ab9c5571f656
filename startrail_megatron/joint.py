"""Joint attention (SD3 / Flux MMDiT) under StarTrail: few text tokens replicated on every
CP rank, many image tokens sharded.

Note [joint attention]
~~~~~~~~~~~~~~~~~~~~~~
One full attention over the concatenation ``[text; image]``. The image tokens are
sharded over the P CP ranks (any layout; ``dit.sharding`` uses one document of the
per-document zigzag layout); the t text tokens, their q, k, v and everything of the text
stream are the same on every rank (computed redundantly, as the conditioning is). Two
parts, each counting every (query, key) pair exactly once:

* image queries: StarTrail over the image K,V (``startrail_attention``), and the text
  K,V as ``joint_kv``: each rank folds them into its own rows before the team combine.
  No extra transfer.
* text queries: rank r computes the partial (o_r, lse_r) of the text queries against its
  own real image keys (rank 0 also against the text keys); one all-gather of the P
  partials over the CP group and the usual merge give the exact output on every rank.

Gradients (the bug class of peers: replicated tokens counted P times, or their gradient
kept on one rank). Each rank's loss covers its own image tokens, so the gradient a rank
receives for a replicated tensor is its part, and the parts over the CP group sum to the
whole (the same convention as the conditioning's parameters, whose gradients are summed
over the CP group like any data-parallel gradient). In the text queries' backward the P
parts of d out_text are summed first (one all-gather and a sum: every partial o_r entered
every rank's output), then each rank computes its partial's gradients: dq_text (its part),
dK,dV of its own image keys (whole), dK,dV of the text keys on rank 0 (whole). The
image queries' text-key gradient is likewise each rank's part.

Communication per call and rank: forward all-gather of (o, lse), backward all-gather of
d out_text, each (P-1) * t * b * hq * (d [+1]) elements in the accumulation dtype, recorded
as ``joint_out`` and ``joint_dout``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import startrail_attention
from .comm import CommLedger, TeamComm, check_agreement
from .groups import StarTrailGroups
from .kernels import AttentionKernel, acc_dtype, resolve_kernel
from .rank import real_rows
from .schedule.packing import PackedLayout
from .validation import check_softcap, first_order_only, packed_layout

__all__ = ["joint_attention", "replicated_query_attention"]


def _keys(k_txt, v_txt, k, v, real, with_text: bool):
    """This rank's key set for the text queries: its real image rows, and on rank 0 first
    the text keys."""
    ki = k if real is None else k.index_select(0, real)
    vi = v if real is None else v.index_select(0, real)
    if with_text:
        return torch.cat((k_txt, ki)), torch.cat((v_txt, vi))
    return ki, vi


class _ReplicatedQueries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_txt, k_txt, v_txt, k, v, groups, scale, kernel, ledger, packed, softcap):
        if ledger is not None:
            ledger.phase = "fwd"
        rank, p = groups.cp_rank, groups.cp_size
        t, b, hq, d = q_txt.shape
        acc = acc_dtype(q_txt.dtype)
        real = real_rows(packed, rank, k.device)
        kk, vv = _keys(k_txt, v_txt, k, v, real, rank == 0)
        cap = {"softcap": softcap} if softcap else {}
        if kk.shape[0]:
            o, lse = kernel.forward(q_txt, kk, vv, causal=False, scale=scale, **cap)
            o, lse = o.to(acc), lse.to(acc)
        else:  # a rank holding padding only
            o = torch.zeros(t, b, hq, d, dtype=acc, device=q_txt.device)
            lse = torch.full((b, hq, t), -torch.inf, dtype=acc, device=q_txt.device)
        comm = TeamComm(groups.cp_group, p, ledger)
        flat = torch.cat((o.reshape(t, -1), lse.permute(2, 0, 1).reshape(t, -1)), dim=1)
        gathered = comm.all_gather(flat, "joint_out").view(p, t, -1)
        o_all = gathered[..., : b * hq * d].view(p, t, b, hq, d)
        lse_all = gathered[..., b * hq * d :].view(p, t, b, hq)
        lse_tot = torch.logsumexp(lse_all, dim=0)  # [t, b, hq]; text keys: never -inf
        out = (torch.exp(lse_all - lse_tot).unsqueeze(-1) * o_all).sum(0)
        ctx.save_for_backward(q_txt, kk, vv, out, lse_tot, real)
        ctx.groups, ctx.scale, ctx.kernel, ctx.ledger = groups, scale, kernel, ledger
        ctx.cap, ctx.shape_k, ctx.t_k = cap, k.shape, k_txt.shape[0] if rank == 0 else 0
        return out.to(q_txt.dtype)

    @staticmethod
    @first_order_only("joint_attention")
    def backward(ctx, dout):
        q_txt, kk, vv, out, lse_tot, real = ctx.saved_tensors
        groups, ledger = ctx.groups, ctx.ledger
        if ledger is not None:
            ledger.phase = "bwd"
        p, acc = groups.cp_size, out.dtype
        comm = TeamComm(groups.cp_group, p, ledger)
        # every rank's partial entered every rank's output: the parts of d out sum first
        do = comm.all_gather(dout.to(acc).contiguous(), "joint_dout")
        do = do.view(p, *dout.shape).sum(0)
        dt = q_txt.dtype
        t_k = ctx.t_k
        dk = torch.zeros(ctx.shape_k, dtype=dt, device=dout.device)
        dv = torch.zeros(ctx.shape_k, dtype=dt, device=dout.device)
        if kk.shape[0] == 0:
            return torch.zeros_like(q_txt), None, None, dk, dv, *(None,) * 6
        gq, gk, gv = ctx.kernel.backward(
            do.to(dt), q_txt, kk, vv, out.to(dt), lse_tot.permute(1, 2, 0).contiguous(),
            causal=False, scale=ctx.scale, **ctx.cap,
        )  # fmt: skip
        gk, gv = gk.to(dt), gv.to(dt)
        gk_img, gv_img = gk[t_k:], gv[t_k:]
        if real is None:
            dk, dv = gk_img, gv_img
        else:
            dk.index_copy_(0, real, gk_img)
            dv.index_copy_(0, real, gv_img)
        if t_k:
            d_ktxt, d_vtxt = gk[:t_k], gv[:t_k]
        else:
            d_ktxt = d_vtxt = None  # rank > 0: the text keys are rank 0's part
        return gq.to(dt), d_ktxt, d_vtxt, dk, dv, *(None,) * 6


def replicated_query_attention(
    q_txt: Tensor,
    k_txt: Tensor,
    v_txt: Tensor,
    k: Tensor,
    v: Tensor,
    groups: StarTrailGroups,
    *,
    softmax_scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
    ledger: CommLedger | None = None,
    cu_seqlens=None,
    cu_seqlens_padded=None,
    softcap: float | None = None,
) -> Tensor:
    """Text queries ``[t, b, hq, d]`` (the same on every CP rank) over the text keys and
    the whole CP-sharded image keys ``k, v [s_local, b, hkv, d]``: the exact output, the
    same on every rank (Note [joint attention]). ``cu_seqlens`` / ``cu_seqlens_padded``:
    as in ``startrail_attention`` (padding keys are left out)."""
    packed, cap, kern, scale = _setup(
        q_txt, k_txt, v_txt, k, v, groups, softmax_scale, kernel, cu_seqlens, cu_seqlens_padded,
        softcap,
    )  # fmt: skip
    _agree(groups, q_txt, k)
    return _ReplicatedQueries.apply(
        q_txt, k_txt, v_txt, k, v, groups, scale, kern, ledger, packed, cap
    )


def _agree(groups: StarTrailGroups, q_txt: Tensor, k: Tensor) -> None:
    """Every CP rank calls with the same shapes (once per setting; else the all-gathers
    would not match): ``ValueError`` naming what differs."""
    t, b, hq, d = q_txt.shape
    fields = {"text tokens": t, "batch": b, "heads_q": hq, "heads_kv": k.shape[2],
              "head_dim": d, "s_local": k.shape[0]}  # fmt: skip
    key = ("replicated queries", *fields.values())
    if groups.cp_size == 1 or key in groups.agreed:
        return
    check_agreement(groups.cp_group, fields, q_txt.device)
    groups.agreed.add(key)


def _setup(
    q_txt, k_txt, v_txt, k, v, groups, softmax_scale, kernel, cu, cu_padded, softcap, q=None
):
    if not isinstance(groups, StarTrailGroups):
        raise ValueError(
            f"groups must be a StarTrailGroups (StarTrailGroups.create), got {type(groups).__name__}"
        )
    for name, x in (("q_txt", q_txt), ("k_txt", k_txt), ("v_txt", v_txt), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point [tokens, batch, heads, head_dim] tensor"
            )
    t, b, hq, d = q_txt.shape
    if q is not None and tuple(q.shape[1:]) != (b, hq, d):
        raise ValueError(
            f"q {tuple(q.shape)} and q_txt {tuple(q_txt.shape)} must share [batch, heads_q, "
            "head_dim]"
        )
    if k_txt.shape != v_txt.shape or k_txt.shape[0] != t or k.shape != v.shape:
        raise ValueError(
            f"q_txt {tuple(q_txt.shape)}, k_txt {tuple(k_txt.shape)}, v_txt {tuple(v_txt.shape)}: "
            "the text q, k, v must have the same tokens, and k, v the same shape"
        )
    if tuple(k.shape[1:]) != tuple(k_txt.shape[1:]) or hq % k.shape[2] or k.shape[3] != d:
        raise ValueError(
            f"k {tuple(k.shape)} and k_txt {tuple(k_txt.shape)} must share [batch, heads_kv, "
            f"head_dim], with heads_q = {hq} a multiple of heads_kv"
        )
    dts = {x.dtype for x in (q_txt, k_txt, v_txt, k, v)}
    if len(dts) != 1:
        raise ValueError(
            f"q_txt, k_txt, v_txt, k, v must share one dtype, got {sorted(map(str, dts))}"
        )
    packed: PackedLayout | None = packed_layout(groups.cp_size, k.shape[0], cu, cu_padded)
    cap = check_softcap(softcap)
    kern, scale = resolve_kernel(q_txt, kernel, softmax_scale, softcap=cap > 0)
    return packed, cap, kern, scale


def joint_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_txt: Tensor,
    k_txt: Tensor,
    v_txt: Tensor,
    groups: StarTrailGroups,
    *,
    softmax_scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
    ledger: CommLedger | None = None,
    cu_seqlens=None,
    cu_seqlens_padded=None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Full attention over ``[text; image]``: (image out ``[s_local, b, hq, d]``, text out
    ``[t, b, hq, d]``), exactly one device's attention over the concatenation.

    ``q, k, v``: this rank's image tokens (``[s_local, b, heads, head_dim]``, CP-sharded,
    any layout; with ``cu_seqlens`` the per-document zigzag one, padding masked);
    ``q_txt, k_txt, v_txt``: the text tokens, the same on every CP rank. Gradients follow
    Note [joint attention]: every replicated input's gradient is this rank's part (sum over
    the CP group, as for the conditioning's parameters).
    """
    packed, cap, kern, scale = _setup(
        q_txt, k_txt, v_txt, k, v, groups, softmax_scale, kernel, cu_seqlens, cu_seqlens_padded,
        softcap, q,
    )  # fmt: skip
    out = startrail_attention(
        q, k, v, groups, causal=False, softmax_scale=scale, kernel=kern, ledger=ledger,
        cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded, softcap=softcap,
        joint_kv=(k_txt, v_txt),
    )  # fmt: skip
    out_txt = _ReplicatedQueries.apply(
        q_txt, k_txt, v_txt, k, v, groups, scale, kern, ledger, packed, cap
    )
    return out, out_txt
