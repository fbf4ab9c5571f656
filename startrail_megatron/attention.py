"""StarTrail attention: forward, backward, and the thin autograd Function.

The schedule (teams, initial KV placement, sub-ring steps) is in
``layout.py``'s Note; which kernel calls a rank makes at a step is
``schedule.plan_step`` (Note [causal balance] in ``schedule/blocks.py``). The
per-rank forward and backward are in ``rank/``; this module holds the thin
autograd Function and the public ``startrail_attention``.

Shapes (Megatron's layout): q ``[s, b, hq, d]``, k/v ``[s, b, hkv, d]`` with
``s`` the local tokens of this CP rank. ``n = C*s`` team tokens; team
buffers are in ascending zigzag-chunk order (``team_chunk_order``).

Communication per rank and attention call (u = s*b*h*d elements of one local
tensor; ``kv`` = K and V together, 2*u_kv; G = P/C^2; C = 1 has no
collectives and is exactly zigzag ring attention):

Forward
  collective  all-gather q         (C-1) u_q             input dtype
              all-gather lse       (C-1) C*s*b*hq        fp32 (fp64 for fp64)
              reduce-scatter out   (C-1) u_q             fp32 (fp64 for fp64)
  P2P         placement  2u_kv to each of the C first holders of the team's KV
                         but itself (``layout.placement_targets``)   input dtype
              sub-ring   (G-1) * C*2u_kv (under a narrow window: one per hop
                         between the steps run, ``KVRing.steps``)  input dtype
Backward (KV travels again; its dK/dV travel with it and go home)
  collective  all-gather dout (C-1) u_q, delta (C-1) s*b*hq (fp32)
              reduce-scatter dq  (C-1) u_q                    fp32
  P2P         placement and kv as in the forward              input dtype
              dkv   (G-1) * C*2u_kv                           fp32
              home  2u_kv to each member of the held copy's team but itself
                    (``layout.dkv_home_targets``)             fp32

K and V need no team collective: the paper all-gathers q, k, v in the team, sends the
team's K,V on to its first holder, returns each copy's dK/dV there and reduce-scatters
them; here each member sends its own K,V straight to the C first holders of its team's
K,V and gets its own rows of each copy's dK/dV straight back (``layout.py``'s Note).
The same K,V is held at every step, with (C-1) 2u_kv fewer elements sent per rank each
way, a collective fewer to wait on each way, and only the rank's own K,V kept for the
backward: (C + 3) A kept from the forward, not the paper's (3C + 1) A.

``StarTrailLayout.p2p_sends`` counts the P2P messages; tests assert these
against the ledger. Why KV travels in the backward, not Q (the paper's
choice): every fused kernel (flash-attn, TE, SDPA) computes the backward from
(dout, out) that stay local that way, the schedule and peers are the forward's,
and with GQA the KV side is the smaller one. Per rank at P = 8, fp32, in units
of one local K+V: C = 1 sends 7 forward and 7 + 8 backward; C = 2 sends at
most 2 + 2 = 4 forward and 4 + 2 + 2 = 8 backward, and no K,V collective.

Note [overlap]
~~~~~~~~~~~~~~
Every transfer starts asynchronously and is waited on only where its result is
needed (``comm/``: ``*_start`` and ``exchange`` return handles; a wait never
synchronizes the device). What runs while each transfer is in flight:

  forward   q all-gather      the initial K,V placement (both started at once), then
                              with ``own_rows_first`` the first step's calls on this
                              rank's own query rows (below)
            both              the joint keys' part of this rank's rows (MMDiT)
            sub-ring KV s+1   step s's kernel calls (double-buffered)
            lse, out of head  the last step's calls on the next head group, and the
              group g         next group's lse (``schedule.tail_head_groups``: two
                              groups with C > 1, G > 1 and two heads or more, no
                              dropout); the last group's lse and out are exposed
  backward  dout, delta       the initial placement, the sinks' gradient, then with
                              ``own_rows_first`` the first step's own-row calls
            sub-ring KV s+1   step s's kernel calls
            dK/dV of step s   step s+1's kernel calls (one step behind the KV; their
                              gradients are then added into it: ``StepDkvSum``)
            dq of head group  the last step's calls on the next head group (as the
              g               forward's combine; the last group's dq with the next row)
            dK/dV home        the last group's dq reduce-scatter, the joint keys' part

Own rows first (``CommOptions(own_rows_first=)``; C > 1, dense, no dropout): the
first computed step's calls are cut by query rows (``schedule.split_own_rows``).
The rank's own rows need only its local q (forward) or dout and delta (backward),
so they run once the placement has arrived, and the team gather is waited on after
them: the same (query, key) pairs in a few more, smaller calls, exact in any order.
That only pays where the gather outlasts the placement: a team spread over hosts
whose gather carries more bytes than the placement (GQA). Elsewhere the gather ends
first and the split only adds calls, so the default (None) splits only there
(``schedule.splits_first_step``, with ``StarTrailGroups.team_hosts``), unless the
groups carry a setting (``StarTrailGroups.own_rows_first``: Megatron's
``--startrail-own-rows-first``, DeepSpeed's ``startrail.own_rows_first``) or
``$STARTRAIL_OWN_ROWS_FIRST`` says ``on`` or ``off`` (``validation.check_comm_options``).
It is rank-local: ranks that differ still exchange the same transfers.

The 2-D split (``UlyssesStarTrailGroups``) adds its all-to-alls around all this: q, k and
v start together and are waited on before StarTrail starts, the output's after it, the
backward's likewise; nothing overlaps them (as in DeepSpeed-Ulysses).

The planner charges exactly this (``planner/times.py``); nothing overlaps the
QKV projection, since q, k, v reach the attention after it. With
``comm.CommOptions(overlap=False)`` every transfer is waited on as it starts,
the same code and bytes with nothing hidden: the benchmark's baseline.
``tests/test_overlap.py`` records the order of starts, waits and kernel calls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .comm import CommLedger, CommOptions, TeamComm
from .groups import StarTrailGroups, UlyssesStarTrailGroups
from .kernels import AttentionKernel, resolve_kernel
from .rank import RankCall, startrail_rank_backward, startrail_rank_forward
from .rank.ulysses import HeadsToSeq, SeqToHeads
from .schedule.ulysses import kv_repeat, ring_segments
from .validation import (
    agree_once,
    check_comm_options,
    check_joint_kv,
    check_options,
    first_order_only,
    packed_layout,
    validate_inputs,
)

__all__ = ["startrail_attention"]


def head_chunk_slices(heads_q: int, heads_kv: int, n: int) -> list[tuple[slice, slice]]:
    """The (query heads, KV heads) of each of ``n`` head chunks: the KV heads in ``n`` equal
    runs, each with its GQA group of query heads."""
    per, group = heads_kv // n, heads_q // heads_kv
    return [
        (slice(i * per * group, (i + 1) * per * group), slice(i * per, (i + 1) * per))
        for i in range(n)
    ]


def _join(parts, dim: int) -> Tensor:
    """The head chunks' parts side by side along ``dim``; one part is itself (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class _StarTrailAttention(torch.autograd.Function):
    """The thin autograd Function over one rank's forward and backward. With
    ``options.head_chunks`` = n > 1 both run n times, on one KV-head group (and its query
    heads) at a time: every team-sized buffer (the gathered q and dout, the combine's
    accumulators, dq, the K,V ring and its dK/dV) is 1/n as large while it lives, for n
    times the messages of the same bytes; the output is written into one tensor, which is
    what the backward keeps of it."""

    @staticmethod
    def forward(
        ctx, q, k, v, sinks, joint_k, joint_v, groups, causal, scale, kernel, ledger, packed,
        options, comm_options,
    ):  # fmt: skip
        if ledger is not None:
            ledger.phase = "fwd"
        rc = RankCall.over_groups(
            groups, causal, ledger, packed=packed, options=options, comm_options=comm_options
        )
        chunks = head_chunk_slices(q.shape[2], k.shape[2], options.head_chunks)
        out = None if len(chunks) == 1 else torch.empty_like(q)  # one chunk: its own out
        saved: list[Tensor] = []
        for qh, kh in chunks:  # one chunk: every slice is the whole tensor (a view)
            joint = None if joint_k is None else (joint_k[:, :, kh], joint_v[:, :, kh])
            part, saved_one = startrail_rank_forward(
                q[:, :, qh], k[:, :, kh], v[:, :, kh], rc, scale, kernel,
                None if sinks is None else sinks[qh], joint,
            )  # fmt: skip
            if out is None:
                out = part
            else:
                out[:, :, qh] = part
            saved.extend(saved_one)
            del part, saved_one
        ctx.save_for_backward(out, *saved, sinks, joint_k, joint_v)
        ctx.rc, ctx.scale, ctx.kernel, ctx.ledger = rc, scale, kernel, ledger
        ctx.chunks = chunks
        return out

    @staticmethod
    @first_order_only("startrail_attention")
    def backward(ctx, dout):
        out, *saved, sinks, joint_k, joint_v = ctx.saved_tensors
        if ctx.ledger is not None:
            ctx.ledger.phase = "bwd"
        dout = dout.contiguous()
        # each chunk's gradients kept as they come and joined at the end, when the chunks'
        # working buffers are gone (a whole dq made first would be held through every
        # chunk's backward)
        parts: list[tuple[Tensor, ...]] = []
        sink_parts, joint_parts = [], []
        for i, (qh, kh) in enumerate(ctx.chunks):  # one chunk: whole tensors, no copies
            joint = None if joint_k is None else (joint_k[:, :, kh], joint_v[:, :, kh])
            grads = startrail_rank_backward(
                dout[:, :, qh].contiguous(), out[:, :, qh], tuple(saved[3 * i : 3 * i + 3]),
                ctx.rc, ctx.scale, ctx.kernel, None if sinks is None else sinks[qh], joint,
            )  # fmt: skip
            parts.append((grads.dq, grads.dk, grads.dv))
            sink_parts.append(grads.sinks)
            joint_parts.append(grads.joint)
            del grads
        dq, dk, dv = (_join(p, 2) for p in zip(*parts))
        del parts
        d_sinks = None if sinks is None else _join(sink_parts, 0).to(sinks.dtype)
        d_jk = d_jv = None
        if joint_k is not None:  # per KV head: the chunks' parts side by side
            d_jk, d_jv = (_join(p, 2).to(joint_k.dtype) for p in zip(*joint_parts))
        return (dq, dk, dv, d_sinks, d_jk, d_jv) + (None,) * 8


def startrail_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    groups: StarTrailGroups | UlyssesStarTrailGroups,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | AttentionKernel = "auto",
    ledger: CommLedger | None = None,
    cu_seqlens=None,
    cu_seqlens_padded=None,
    dropout_p: float = 0.0,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    joint_kv: tuple[Tensor, Tensor] | None = None,
    comm_options: CommOptions | None = None,
    tile: int | None = None,
    head_chunks: int | None = None,
) -> Tensor:
    """Exact attention over the whole CP-sharded sequence, StarTrail schedule.

    Args:
        q: ``[s_local, b, heads_q, head_dim]``, this CP rank's tokens.
        k, v: ``[s_local, b, heads_kv, head_dim]``; heads_q % heads_kv == 0.
        groups: from ``StarTrailGroups.create`` (same on every CP rank), or from
            ``UlyssesStarTrailGroups.create``: the 2-D split (``schedule/ulysses.py``'s
            Note), which takes everything below except ``dropout_p`` and ``joint_kv``
            (refused by name) and needs ``heads_q`` divisible by U and ``heads_kv`` and
            U dividing one another.
        causal: causal mask over the global sequence; the inputs must then be
            in Megatron's zigzag layout (CP rank r holds chunks r and 2P-1-r
            of 2P, as ``zigzag_shard`` / ``get_batch_on_this_cp_rank`` give).
            Without it any token layout works.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        kernel: a kernel name (``"auto"`` or one of ``kernels.KERNEL_NAMES``;
            ``$STARTRAIL_KERNEL`` replaces ``"auto"``) or a kernel object.
        ledger: a ``CommLedger`` that records every transfer (forward and
            backward) of this call on this rank.
        cu_seqlens, cu_seqlens_padded: packed documents (Megatron/TE's
            ``PackedSeqParams.cu_seqlens_q`` / ``cu_seqlens_q_padded``: global
            boundaries, lists or 1-D integer tensors; the padded ones default to
            the real ones). Attention stays inside each document, causal or
            full. The inputs must then be in the per-document zigzag layout
            (every padded document length a multiple of 2P, CP rank r holding
            each document's chunks r and 2P-1-r: ``zigzag.shard_packed``);
            padding tokens get zero output and zero gradients. The same on
            every CP rank. CUDA tensors are read on the host once per call.
            Kernels with variable-length methods (flash-attn's varlen functions,
            TE's THD format) get one call per block-plan call over all the
            documents; the others one call per document and block.
        dropout_p: attention dropout (0 <= p < 1; pass 0 in evaluation): every kernel
            call drops its attention probabilities after the softmax statistics are
            taken, as flash-attn does, and its backward rebuilds the same mask from the
            RNG state the forward saved. The reference kernel draws from the default
            generator of q's device (Megatron's RNG tracker ``fork`` swaps it), flash-attn
            from the CUDA generator: a run is reproducible with the same seed and layout.
            ``0`` runs exactly the code without dropout.
        window: a sliding window ``(left, right)`` in Megatron's / flash-attn's convention:
            query i sees keys ``i - left .. i + right`` (``-1``: unbounded; ``(-1, 0)`` with
            ``causal`` is plain causal, ``(W - 1, 0)`` a causal window of W tokens). The
            inputs must be in the zigzag layout (``zigzag_shard``), causal or not. Calls
            are split where the team buffer is not globally contiguous and trimmed to the
            window; calls with nothing in it are not made (``schedule.windows``). A window that
            masks nothing runs exactly the code without one.
        softcap: logit soft-capping ``cap * tanh(s / cap)`` inside every call (Gemma 2);
            ``None`` or 0: off.
        sinks: ``[heads_q]`` learned attention-sink logits (GPT-OSS), the same on every
            CP rank; they join each row's softmax denominator once, in the final
            combine, and receive their gradient (this rank's rows' part).
        joint_kv: ``(k_joint, v_joint)``, each ``[t, b, heads_kv, head_dim]``: keys the same
            on every CP rank that every query also sees (the text tokens of MMDiT joint
            attention; ``joint.joint_attention`` adds their own queries). Each rank adds them
            to its own rows, so they count once per query; their gradient from this rank's
            rows flows back (the ranks' parts sum to the whole: sum them over the CP group
            with the other replicated gradients). Full attention only (``causal=False``),
            no dropout or window; no extra communication.
        comm_options: ``comm.CommOptions`` for this call's transfers: the benchmark's
            injected per-transfer delay and no-overlap baseline (CPU ranks); default:
            overlapped, no delay. Each wait is timed into ``ledger`` on CPU ranks.
        tile: the largest kernel call, in tokens: every call is cut into calls of at most
            ``tile`` query rows by ``tile`` key rows (``schedule.tile_calls``; window calls
            by rows only, variable-length calls whole), in both directions. The same
            result; the backward's transient memory (a call's dq, dK, dV and output
            stand-in) is then bounded by the tile, not by the sequence, at the price of
            more, smaller calls: for long sequences on kernels that materialize a call's
            gradients whole (every kernel does). ``None`` (default): whole calls.
            Rank-local (ranks may differ).
        head_chunks: run the call on ``head_chunks`` groups of KV heads (each with its
            query heads) one after the other, forward and backward: the team's buffers
            (gathered q and dout, fp32 output and dq accumulators, the K,V ring and its
            dK/dV) then hold one group's heads at a time, 1/``head_chunks`` as large, for
            ``head_chunks`` times the messages (the same bytes). Must divide the KV heads
            (with the 2-D split: those each ring rank holds after the all-to-all); not
            with dropout yet. The same on every CP rank. ``None`` or 1: all heads at once.

    Returns:
        out ``[s_local, b, heads_q, head_dim]`` in q's dtype.
    """
    if not isinstance(groups, (StarTrailGroups, UlyssesStarTrailGroups)):
        raise ValueError(
            "groups must be a StarTrailGroups or UlyssesStarTrailGroups (their .create), got "
            f"{type(groups).__name__}"
        )
    validate_inputs(q, k, v, groups.cp_size, causal)
    packed = packed_layout(groups.cp_size, q.shape[0], cu_seqlens, cu_seqlens_padded)
    ring_kv = k.shape[2]
    if isinstance(groups, UlyssesStarTrailGroups):  # the KV heads each ring rank holds
        u = groups.ulysses_size
        ring_kv = k.shape[2] * kv_repeat(u, q.shape[2], k.shape[2]) // u
    opts = check_options(
        q, groups.cp_size, causal, dropout_p, window, softcap, sinks, tile, head_chunks, ring_kv
    )
    if isinstance(groups, UlyssesStarTrailGroups):
        return _ulysses_startrail(
            q, k, v, groups, causal, softmax_scale, kernel, ledger, packed, opts, sinks,
            joint_kv, comm_options, window, softcap,
        )  # fmt: skip
    jk, jv = check_joint_kv(joint_kv, k, causal, opts)
    comm_options = check_comm_options(comm_options, q, groups.own_rows_first)
    kern, scale = resolve_kernel(q, kernel, softmax_scale, **opts.kernel_needs)
    agree_once(
        groups, q, k, bool(causal), packed, opts, sinks is not None, scale=scale,
        joint_tokens=0 if jk is None else jk.shape[0],
    )  # fmt: skip
    return _StarTrailAttention.apply(
        q, k, v, sinks, jk, jv, groups, bool(causal), scale, kern, ledger, packed, opts,
        comm_options,
    )  # fmt: skip


def _ulysses_startrail(
    q, k, v, groups, causal, softmax_scale, kernel, ledger, packed, opts, sinks, joint_kv,
    comm_options, window, softcap,
):  # fmt: skip
    """The 2-D split (``schedule/ulysses.py``'s Note): all-to-all to head shards over the
    Ulysses group, StarTrail over the ring group, all-to-all back; checked (the same
    ``ValueError`` on every rank) before any transfer."""
    u = groups.ulysses_size
    refused = {"dropout_p > 0": opts.dropout_p > 0, "joint_kv": joint_kv is not None}
    for what, bad in refused.items():
        if bad:
            raise ValueError(
                f"{what} is not supported with ulysses_size > 1 (ulysses_size={u}) yet: use "
                "StarTrailGroups (no Ulysses split) for it"
            )
    repeat = kv_repeat(u, q.shape[2], k.shape[2])
    comm_options = check_comm_options(comm_options, q, groups.own_rows_first)
    # the kernel is chosen (and refused by name where it lacks a variant) before any transfer
    kern, scale = resolve_kernel(q, kernel, softmax_scale, **opts.kernel_needs)
    agree_once(groups, q, k, bool(causal), packed, opts, sinks is not None, scale=scale)
    if packed is not None:
        docs = tuple(2 * packed.chunk_len(d) for d in range(packed.num_docs))
    elif causal or opts.window is not None:
        docs = (q.shape[0],)
    else:
        docs = None  # full attention: any token order
    runs = ring_segments(u, docs)
    comm = TeamComm(groups.ulysses_group, u, ledger, comm_options)
    if repeat > 1:  # GQA with fewer KV heads than U: each member gets one (Note, GQA)
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    names = ("q (ulysses)", "k (ulysses)", "v (ulysses)")
    qh, kh, vh = SeqToHeads.apply(comm, runs, ledger, names, q, k, v)
    if sinks is not None:
        per = q.shape[2] // u
        sinks = sinks[groups.ulysses_rank * per : (groups.ulysses_rank + 1) * per]
    cu = cu_pad = None
    if packed is not None:
        cu, cu_pad = list(packed.cu_seqlens), list(packed.cu_seqlens_padded)
    out = startrail_attention(
        qh, kh, vh, groups.startrail, causal=causal, softmax_scale=scale,
        kernel=kern, ledger=ledger, cu_seqlens=cu, cu_seqlens_padded=cu_pad,
        window=window, softcap=softcap,
        sinks=sinks, comm_options=comm_options, tile=opts.tile, head_chunks=opts.head_chunks,
    )  # fmt: skip
    return HeadsToSeq.apply(comm, runs, ledger, "out (ulysses)", out)
