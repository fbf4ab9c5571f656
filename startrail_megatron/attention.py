"""StarTrail attention: forward, backward, and the thin autograd Function.

The schedule (teams, initial KV placement, sub-ring steps) is in
``layout.py``'s Note; which kernel calls a (Q team, KV team) block needs is
in ``block_plan.py``'s Note. This module moves the tensors.

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
                         between the steps run, ``RankContext.steps``)  input dtype
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
              group g         next group's lse (``block_plan.tail_head_groups``: two
                              groups with C > 1, G > 1 and two heads or more, no
                              dropout); the last group's lse and out are exposed
  backward  dout, delta       the initial placement, the sinks' gradient, then with
                              ``own_rows_first`` the first step's own-row calls
            initial placement the out stand-in (``_delta_out``)
            sub-ring KV s+1   step s's kernel calls
            dK/dV of step s   step s+1's kernel calls (one step behind the KV; their
                              gradients are then added into it: ``_StepDkv``)
            dq of head group  the last step's calls on the next head group (as the
              g               forward's combine; the last group's dq with the next row)
            dK/dV home        the last group's dq reduce-scatter, the joint keys' part

Own rows first (``CommOptions(own_rows_first=)``; C > 1, dense, no dropout): the
first computed step's calls are cut by query rows (``block_plan.split_own_rows``).
The rank's own rows need only its local q (forward) or dout and delta (backward),
so they run once the placement has arrived, and the team gather is waited on after
them: the same (query, key) pairs in a few more, smaller calls, exact in any order.
That only pays where the gather outlasts the placement: a team spread over hosts
whose gather carries more bytes than the placement (GQA). Elsewhere the gather ends
first and the split only adds calls, so the default (None) splits only there
(``block_plan.own_rows_first_pays``, with ``StarTrailGroups.team_hosts``), unless the
groups carry a setting (``StarTrailGroups.own_rows_first``: Megatron's
``--startrail-own-rows-first``, DeepSpeed's ``startrail.own_rows_first``) or
``$STARTRAIL_OWN_ROWS_FIRST`` says ``on`` or ``off`` (``validation.check_comm_options``).
It is rank-local: ranks that differ still exchange the same transfers.

The planner charges exactly this (``planner/times.py``); nothing overlaps the
QKV projection, since q, k, v reach the attention after it. With
``comm.CommOptions(overlap=False)`` every transfer is waited on as it starts,
the same code and bytes with nothing hidden: the benchmark's baseline.
``tests/test_overlap.py`` records the order of starts, waits and kernel calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .block_plan import (
    VarlenCall,
    own_rows_first_pays,
    own_team_rows,
    packed_team_order,
    split_own_rows,
    startrail_active_steps,
    startrail_step_packed_window_rows,
    startrail_step_rows,
    startrail_step_varlen,
    startrail_step_window_rows,
    tail_head_groups,
)
from .comm import (
    DEFAULT_COMM,
    CommLedger,
    CommOptions,
    DoneHandle,
    P2PComm,
    PeerExchange,
    TeamCollectives,
    TeamComm,
)
from .groups import StarTrailGroups
from .kernels import (
    AttentionKernel,
    Dropout,
    acc_dtype,
    has_varlen,
    merge_partial,
    resolve_kernel,
)
from .layout import StarTrailLayout
from .packing import PackedLayout
from .validation import (
    NO_OPTIONS,
    AttnOptions,
    agree_once,
    check_comm_options,
    check_joint_kv,
    check_options,
    packed_layout,
    validate_inputs,
)
from .zigzag import inverse_order, reorder_chunks

__all__ = [
    "RankContext",
    "startrail_attention",
    "startrail_rank_backward",
    "startrail_rank_forward",
    "validate_inputs",
]


def _index_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host ints on ``device``; to CUDA through pinned memory without a blocking copy
    (built once per packed layout, in the first layer's call)."""
    x = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@lru_cache(maxsize=8)  # one team per rank: the batches in flight (forward, backward)
def _team_rows_index(
    layout: StarTrailLayout, team: int, packed: PackedLayout, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """(order, its inverse) of ``block_plan.packed_team_order`` as index tensors on
    ``device``, built once per packed layout rather than in every layer's call; ``None``
    when the order is the identity (a team of one rank)."""
    order = packed_team_order(layout, team, packed)
    if order == tuple(range(len(order))):
        return None
    idx = _index_tensor(list(order), torch.long, device)
    return idx, torch.argsort(idx)


@dataclass(frozen=True)
class _VarlenIndex:
    """A ``VarlenCall`` as tensors: the team-buffer rows it gathers (one batch row's
    worth: every batch row has the same documents) and the THD offsets of its
    ``b * len(segments)`` sequences (batch-major, as the gathered rows are laid out)."""

    q_rows: Tensor
    kv_rows: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal: bool


def _rows_and_offsets(segs, b: int, device) -> tuple[Tensor, Tensor, int]:
    rows = [i for lo, hi in segs for i in range(lo, hi)]
    lens = [hi - lo for lo, hi in segs] * b
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return (
        _index_tensor(rows, torch.long, device),
        _index_tensor(cu, torch.int32, device),
        max(lens),
    )


@lru_cache(maxsize=64)  # the calls of the batches in flight, on each device
def _varlen_index(call: VarlenCall, b: int, device: torch.device) -> _VarlenIndex:
    q_rows, cu_q, max_q = _rows_and_offsets(call.q_segments, b, device)
    kv_rows, cu_k, max_k = _rows_and_offsets(call.kv_segments, b, device)
    return _VarlenIndex(q_rows, kv_rows, cu_q, cu_k, max_q, max_k, call.causal)


def _to_thd(x: Tensor, rows: Tensor) -> Tensor:
    """Team-buffer rows ``[n, b, h, d]`` -> the THD tensor ``[b * len(rows), h, d]`` of
    those rows, batch-major (a copy; no second one when b == 1)."""
    g = x.index_select(0, rows)
    return g.transpose(0, 1).reshape(-1, *g.shape[2:])


def _from_thd(x: Tensor, b: int) -> Tensor:
    """THD ``[b * t, h, d]`` (batch-major) -> ``[t, b, h, d]`` (a view)."""
    return x.view(b, -1, *x.shape[1:]).transpose(0, 1)


@lru_cache(maxsize=8)  # as _team_rows_index: built once per layout, not in every layer's call
def _real_rows_of(packed: PackedLayout | None, cp_rank: int, device: torch.device) -> Tensor | None:
    """CP rank ``cp_rank``'s local rows that are real tokens (``PackedLayout.real_rows``)
    as an index tensor on ``device``, or ``None`` when all are (or nothing is packed)."""
    if packed is None:
        return None
    rows = packed.real_rows(cp_rank)
    if len(rows) == packed.s_local:
        return None
    return _index_tensor(list(rows), torch.long, device)


def _real_rows(cx: RankContext, device: torch.device) -> Tensor | None:
    return _real_rows_of(cx.packed, cx.rank, device)


def _member_rows(cx: RankContext, x: Tensor, s: int) -> Tensor:
    """This member's own ``s`` rows (member order) of team-order rows ``x`` (dim 0)."""
    return cx.from_team_order(x)[cx.member * s : (cx.member + 1) * s]


def _joint_forward(cx, q, joint, acc_out, acc_lse, scale, kernel) -> None:
    """Fold the joint keys (replicated on every CP rank) into this member's own rows of the
    team accumulators: each query row of the team sees them once, from its own rank."""
    s = q.shape[0]
    real = _real_rows(cx, q.device)
    rows = torch.arange(s, device=q.device) if real is None else real
    if rows.numel() == 0:
        return
    qr = q if real is None else q.index_select(0, real)
    o, lse = kernel.forward(
        qr, joint[0], joint[1], causal=False, scale=scale, **_cap_kw(cx.softcap)
    )
    n = acc_out.shape[0]
    team_pos = cx.from_team_order(torch.arange(n, device=q.device))[cx.member * s + rows]
    sub_o, sub_l = acc_out.index_select(0, team_pos), acc_lse.index_select(2, team_pos)
    merge_partial(sub_o, sub_l, o, lse)
    acc_out.index_copy_(0, team_pos, sub_o)
    acc_lse.index_copy_(2, team_pos, sub_l)


def _joint_backward(cx, dout, out, q_team, lse_team, joint, scale, kernel, acc) -> Tensor:
    """The joint keys' part of this rank's rows: returns their dq (local rows, ``acc``)
    and leaves the joint keys' gradient from these rows in ``cx.joint_grad`` (the ranks'
    parts sum to the whole, as for any replicated input)."""
    s = dout.shape[0]
    jk, jv = joint
    g_q = torch.zeros(dout.shape, dtype=acc, device=dout.device)
    cx.joint_grad = (
        torch.zeros(jk.shape, dtype=acc, device=jk.device),
        torch.zeros(jv.shape, dtype=acc, device=jv.device),
    )
    real = _real_rows(cx, dout.device)
    if real is not None and real.numel() == 0:
        return g_q
    q_loc = _member_rows(cx, q_team, s)
    lse_loc = _member_rows(cx, lse_team.permute(2, 0, 1), s)  # [s, b, hq]
    pick = (lambda x: x) if real is None else (lambda x: x.index_select(0, real))
    gq, gk, gv = kernel.backward(
        pick(dout), pick(q_loc), jk, jv, pick(out), pick(lse_loc).permute(1, 2, 0).contiguous(),
        causal=False, scale=scale, **_cap_kw(cx.softcap),
    )  # fmt: skip
    if real is None:
        g_q += gq.to(acc)
    else:
        g_q.index_add_(0, real, gq.to(acc))
    cx.joint_grad = (gk.to(acc), gv.to(acc))
    return g_q


def _drop_kw(drop: Dropout | None) -> dict:
    """``dropout=`` only when there is dropout: kernels without it keep their signature."""
    return {} if drop is None else {"dropout": drop}


def _cap_kw(softcap: float) -> dict:
    return {"softcap": softcap} if softcap else {}


def _varlen_forward(
    kernel, call, q_team, kv_cur, acc_out, acc_lse, scale, drop=None, softcap=0.0
) -> None:
    """One ``VarlenCall`` of the forward: gather its rows, one kernel call, fold the
    result into the running (acc_out, acc_lse) of those rows."""
    b = q_team.shape[1]
    ix = _varlen_index(call, b, q_team.device)
    o, lse = kernel.forward_varlen(
        _to_thd(q_team, ix.q_rows),
        _to_thd(kv_cur[:, 0], ix.kv_rows),
        _to_thd(kv_cur[:, 1], ix.kv_rows),
        ix.cu_q, ix.cu_k, ix.max_q, ix.max_k, causal=ix.causal, scale=scale, **_drop_kw(drop),
        **_cap_kw(softcap),
    )  # fmt: skip
    hq = q_team.shape[2]
    part_out = acc_out.index_select(0, ix.q_rows)
    part_lse = acc_lse.index_select(2, ix.q_rows)
    merge_partial(part_out, part_lse, _from_thd(o, b), lse.view(hq, b, -1).transpose(0, 1))
    acc_out.index_copy_(0, ix.q_rows, part_out)
    acc_lse.index_copy_(2, ix.q_rows, part_lse)


def _varlen_backward(
    kernel, call, do_team, q_team, kv_cur, out_eff, lse_team, dq, dkv, scale, drop=None,
    softcap=0.0,
):  # fmt: skip
    """One ``VarlenCall`` of the backward: gradients added into dq's rows and, through
    ``dkv`` (``_StepDkv.add`` on this head group), into the step's dK/dV."""
    b, hq = q_team.shape[1], q_team.shape[2]
    ix = _varlen_index(call, b, q_team.device)
    lse = lse_team.index_select(2, ix.q_rows).transpose(0, 1).reshape(hq, -1)  # [hq, b*t]
    g_q, g_k, g_v = kernel.backward_varlen(
        _to_thd(do_team, ix.q_rows),
        _to_thd(q_team, ix.q_rows),
        _to_thd(kv_cur[:, 0], ix.kv_rows),
        _to_thd(kv_cur[:, 1], ix.kv_rows),
        _to_thd(out_eff, ix.q_rows),
        lse,
        ix.cu_q, ix.cu_k, ix.max_q, ix.max_k, causal=ix.causal, scale=scale, **_drop_kw(drop),
        **_cap_kw(softcap),
    )  # fmt: skip
    acc = dq.dtype
    dq.index_add_(0, ix.q_rows, _from_thd(g_q, b).to(acc))
    del g_q
    rows = ix.kv_rows

    def add(t: Tensor) -> None:
        t[:, 0].index_add_(0, rows, _from_thd(g_k, b).to(acc))
        t[:, 1].index_add_(0, rows, _from_thd(g_v, b).to(acc))

    dkv(add)


def _forward_call(kernel, q, k, v, out_rows, lse_rows, causal, scale, kw) -> None:
    """One row call of the forward, merged into the accumulators' rows (views)."""
    o, lse = kernel.forward(q, k, v, causal=causal, scale=scale, **kw)
    merge_partial(out_rows, lse_rows, o, lse)


def _backward_call(kernel, do, q, kv, out, lse, dq_rows, dkv, causal, scale, kw) -> None:
    """One row call of the backward (``kv``: the call's K,V rows ``[t, 2, ...]``): dq's
    gradient added into ``dq_rows`` (a view), dK/dV's through ``dkv`` (``_StepDkv.rows``:
    at once, or where the step's accumulator is still arriving, once it has)."""
    g_q, g_k, g_v = kernel.backward(
        do, q, kv[:, 0], kv[:, 1], out, lse, causal=causal, scale=scale, **kw
    )
    dq_rows += g_q
    dkv(g_k, g_v)


def _row_call(c: tuple, cap: dict) -> tuple:
    """A ``RowCall`` or ``WindowCall`` as the loops slice it: (q rows, kv rows, causal,
    kernel keywords: the band of a window call, soft-capping)."""
    if len(c) == 6:
        return slice(c[0], c[1]), slice(c[2], c[3]), False, {"band": (c[4], c[5]), **cap}
    return slice(c[0], c[1]), slice(c[2], c[3]), c[4], cap


class RankContext:
    """One rank's state for one attention call, shared by its forward and backward.

    ``comms`` is the ``(TeamCollectives, PeerExchange)`` pair the schedule runs
    on (``comm/protocols.py``); by default the ``torch.distributed`` transport
    over ``groups`` (``TeamComm``, ``P2PComm``). ``one_process.py`` passes the
    in-process transport instead; the algorithm below is the same either way.
    ``packed``: the documents of a packed sequence (``packing.py``), or ``None``.
    ``options``: the call's checked ``AttnOptions``: attention dropout (the forward keeps
    one ``Dropout`` record per kernel call, its RNG state, which the backward hands the
    same call again), a normalized sliding window ``(left, right)`` (``None`` sides
    unbounded), logit soft-capping (0: off). ``comm_options``: the default transport's
    ``CommOptions`` (the benchmark's injected delay and no-overlap mode).
    """

    def __init__(
        self,
        groups: StarTrailGroups,
        causal: bool,
        ledger: CommLedger | None,
        comms: tuple[TeamCollectives, PeerExchange] | None = None,
        packed: PackedLayout | None = None,
        options: AttnOptions = NO_OPTIONS,
        comm_options: CommOptions = DEFAULT_COMM,
    ):
        lay = groups.layout
        self.window, self.softcap = options.window, options.softcap
        self.dropout_p = options.dropout_p
        self.dropouts: dict[tuple[int, int], Dropout] = {}
        self.layout, self.causal, self.ledger = lay, causal, ledger
        self.rank = groups.cp_rank
        self.team, self.member = lay.coord(self.rank)
        self.active = None  # the steps each sub-ring computes: ``steps``
        if comms is None:
            comms = (
                TeamComm(groups.team_group, lay.team_size, ledger, comm_options),
                P2PComm(groups.cp_group, self.rank, ledger, comm_options),
            )
        self.team_comm, self.p2p = comms
        self.own_rows_first = comm_options.own_rows_first
        self.team_hosts = groups.team_hosts
        self.subring = groups.subring_group
        self.packed = packed
        if packed is None:  # zigzag chunks (causal) or any layout (full): equal chunks
            c2 = 2 * lay.team_size
            self.perm = lay.team_chunk_order(self.team) if causal else list(range(c2))
            self.inv_perm = inverse_order(self.perm)

    def _packed_index(self, device: torch.device, inverse: bool) -> Tensor | None:
        index = _team_rows_index(self.layout, self.team, self.packed, device)
        return None if index is None else index[inverse]

    def to_team_order(self, x: Tensor) -> Tensor:
        """The all-gathered member order -> the team buffer's order (rows, dim 0)."""
        if self.packed is None:
            return reorder_chunks(x, self.perm)
        idx = self._packed_index(x.device, False)
        return x if idx is None else x.index_select(0, idx)

    def from_team_order(self, x: Tensor) -> Tensor:
        """The team buffer's order -> member order (the inverse of ``to_team_order``)."""
        if self.packed is None:
            return reorder_chunks(x, self.inv_perm)
        idx = self._packed_index(x.device, True)
        return x if idx is None else x.index_select(0, idx)

    def step_calls(self, step: int, s_local: int, kernel: AttentionKernel, own_first: bool = False):
        """This rank's kernel calls at ``step`` (``block_plan``), as (varlen calls, row
        calls, own-row calls), at most one of the first two non-empty: packed documents on
        a kernel with variable-length methods are grouped over the documents
        (``startrail_step_varlen``); otherwise one call per row block, each ``(q rows,
        kv rows, causal, kernel keywords)``: ``startrail_step_rows`` (dense or per
        document), or under a sliding window ``startrail_step_window_rows`` (calls on
        globally contiguous runs, each with its ``band``).

        ``own_first`` (the first computed step, where ``split_first`` says so): the calls
        on this rank's own query rows come apart (``split_own_rows``) as ``(q rows, local
        q rows, kv rows, causal, keywords)``: they need only local queries and output
        gradients, so they run while the team's are gathered; the row calls then hold the
        other rows. Otherwise the third part is empty."""
        lay, r = self.layout, self.rank
        cap = {"softcap": self.softcap} if self.softcap else {}
        if self.packed is not None and self.window is None and has_varlen(kernel):
            return startrail_step_varlen(lay, r, step, self.causal, self.packed), (), ()
        if self.window is None:
            calls = startrail_step_rows(lay, r, step, self.causal, s_local, self.packed)
        elif self.packed is not None:
            calls = startrail_step_packed_window_rows(
                lay, r, step, self.causal, self.packed, self.window
            )
        else:
            calls = startrail_step_window_rows(lay, r, step, self.causal, s_local, self.window)
        own: tuple = ()
        if own_first:
            own, calls = split_own_rows(calls, own_team_rows(lay, r, self.causal, s_local))
        mine = []
        for c, sh in own:
            qs, ks, causal, kw = _row_call(c, cap)
            mine.append((qs, slice(qs.start + sh, qs.stop + sh), ks, causal, kw))
        return (), [_row_call(c, cap) for c in calls], mine

    def split_first(self, heads_q: int, heads_kv: int) -> bool:
        """Whether the first step runs its own rows' calls first: only with a team gather
        to hide (C > 1), dense rows (packed documents map rows per document) and no
        dropout (its records are keyed by call); then ``CommOptions(own_rows_first=)``,
        or where it is None, ``block_plan.own_rows_first_pays``."""
        if self.layout.team_size == 1 or self.packed is not None or self.dropout_p:
            return False
        if self.own_rows_first is None:
            return own_rows_first_pays(self.layout, heads_q, heads_kv, self.team_hosts)
        return self.own_rows_first

    def steps(self, s_local: int) -> tuple[int, ...]:
        """The sub-ring steps this rank computes (``block_plan.startrail_active_steps``,
        kept in ``self.active``): all G, but under a sliding window the steps idle on
        every rank of its sub-ring are skipped, and the KV goes straight past them
        (``ring_step``)."""
        packed = self.packed
        self.active = startrail_active_steps(
            self.layout, self.causal, s_local if packed is None else packed.s_local,
            self.window, packed,
        )  # fmt: skip
        return self.layout.computed_steps(self.rank, self.active)

    def dropout(self, step: int, call: int) -> Dropout | None:
        """The dropout record of kernel call ``call`` at ``step``: new in the forward, the
        same one in the backward (``None`` without dropout)."""
        if not self.dropout_p:
            return None
        rec = self.dropouts.get((step, call))
        if rec is None:
            rec = self.dropouts[step, call] = Dropout(self.dropout_p)
        return rec

    def ring_step(
        self, x: Tensor, steps: tuple[int, ...], i: int, what: str, out: Tensor | None = None
    ):
        """Start passing ``x`` on along the sub-ring to the rank that holds it at the next
        computed step ``steps[i + 1]`` (the next rank, or further past idle steps), and
        receiving from the one that holds ours now; None after the last step. ``out``: a
        free buffer like ``x`` to receive into."""
        if i >= len(steps) - 1:
            return None
        lay, hops = self.layout, steps[i + 1] - steps[i]
        return self.p2p.exchange(
            x, lay.ring_shift(self.rank, hops), lay.ring_shift(self.rank, -hops), what,
            self.subring, out,
        )  # fmt: skip

    def initial_placement(self, kv_local: Tensor):
        """Start the initial KV placement (layout Note, step 2): this rank's K,V to the C
        ranks holding its team's KV at their sub-rings' first computed steps, one piece
        from each member of the team whose KV this rank holds at its first one, received
        into one member-order buffer (C > 1). Returns (the handle, that buffer or
        ``None``); ``team_kv`` turns them into the team's K,V in team order. After
        ``steps``."""
        lay, r, c = self.layout, self.rank, self.layout.team_size
        sends = [(d, kv_local) for d in lay.placement_targets(r, self.active)]
        buf = kv_local.new_empty((c * kv_local.shape[0], *kv_local.shape[1:])) if c > 1 else None
        srcs = lay.placement_sources(r, self.active)
        return self.p2p.exchange_many(sends, srcs, kv_local, "kv_place", out=buf), buf

    def team_kv(self, placement) -> Tensor:
        """Wait for the placement (``initial_placement``'s pair) -> the team's K,V buffer
        in team order (C = 1: the one piece itself)."""
        handle, buf = placement
        pieces = handle.wait()
        return pieces[0] if buf is None else self.to_team_order(buf)

    def send_dkv_home(self, dkv: Tensor):
        """Start sending each member its rows of the copy's dK/dV held after the last
        computed step (team order in); ``wait()`` gives this rank's rows of each copy of
        its team's dK/dV, to be summed."""
        lay, r, c = self.layout, self.rank, self.layout.team_size
        parts = self.from_team_order(dkv).chunk(c, dim=0) if c > 1 else (dkv,)
        sends = list(zip(lay.dkv_home_targets(r, self.active), parts))
        srcs = lay.dkv_home_sources(r, self.active)
        return self.p2p.exchange_many(sends, srcs, parts[0], "dkv_home")


_ALL_HEADS = ((slice(None), slice(None)),)
"""One (q heads, kv heads) group of every head: the steps before the last
(``block_plan.tail_head_groups`` splits the last one)."""


def startrail_rank_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cx: RankContext,
    scale: float,
    kernel: AttentionKernel,
    sinks: Tensor | None = None,
    joint: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """One rank's forward: (out ``[s, b, hq, d]`` in q's dtype, what the backward needs).

    The saved tuple is (q_team, kv_local, lse_team): the team's queries in chunk
    order, this rank's own K,V stacked ``[s, 2, b, hkv, d]`` (the backward places it
    again) and the rows' merged log-sum-exp. ``sinks`` (one logit per query head)
    enter once, in the final combine: ``lse = logaddexp(lse, sink)``. ``joint``: keys and
    values ``[t, b, hkv, d]`` the same on every CP rank (MMDiT text tokens), which every
    (real) query sees once: each rank adds them to its own rows before the team combine.
    """
    C = cx.layout.team_size
    s, b, hq, d = q.shape
    n = C * s
    acc = acc_dtype(q.dtype)
    # 1-2. The initial KV placement (each member's K,V straight to its team's C first
    # holders) and the team all-gather of q, in flight together (Note [overlap]).
    kv_local = torch.stack((k, v), dim=1)  # [s, 2, b, hkv, d]: kept for the backward
    steps = cx.steps(s)
    place = cx.initial_placement(kv_local)
    q_h = cx.team_comm.all_gather_start(q, "q_team")
    acc_out = torch.zeros(n, b, hq, d, dtype=acc, device=q.device)
    acc_lse = torch.full((b, hq, n), -math.inf, dtype=acc, device=q.device)
    if joint is not None:  # local rows only: computed while the transfers are in flight
        _joint_forward(cx, q, joint, acc_out, acc_lse, scale, kernel)
    q_team = None if C > 1 else q.contiguous()  # gathered below, at the first step
    split = cx.split_first(hq, k.shape[2])
    kv_cur = cx.team_kv(place)  # [n, 2, b, hkv, d], team order
    del place  # its member-order buffer
    # 3. G sub-ring steps (those with work: ``cx.steps``); the next KV is in flight while
    # this one computes, received into the buffer the step before last computed on (two
    # buffers, reused). The last step runs head group by head group (``tail_head_groups``):
    # each group's team combine starts as soon as its heads are done and runs while the
    # next group computes (Note [overlap]).
    spare = None
    tail = _TailCombine(cx, acc_out, acc_lse, sinks, k.shape[2])
    for i, step in enumerate(steps):
        pending = cx.ring_step(kv_cur, steps, i, "kv", spare)
        if pending is None:  # the last step receives no K,V: its spare buffer is dead
            spare = None
        varlen, rows, own = cx.step_calls(step, s, kernel, own_first=split and q_team is None)
        if q_team is None:  # the first step's calls on this rank's own rows, then the rest
            for qs, ql, ks, causal, kw in own:  # local queries: while the others' arrive
                _forward_call(
                    kernel, q[ql], kv_cur[ks, 0], kv_cur[ks, 1], acc_out[qs], acc_lse[..., qs],
                    causal, scale, kw,
                )  # fmt: skip
            q_team = cx.to_team_order(q_h.wait())
        groups = tail.groups if i == len(steps) - 1 else _ALL_HEADS
        for g, (qh, kh) in enumerate(groups):
            q_g, kv_g = q_team[:, :, qh], kv_cur[:, :, :, kh]
            out_g, lse_g = acc_out[:, :, qh], acc_lse[:, qh]
            for j, call in enumerate(varlen):
                drop = cx.dropout(step, j)
                _varlen_forward(kernel, call, q_g, kv_g, out_g, lse_g, scale, drop, cx.softcap)
            for j, (qs, ks, causal, kw) in enumerate(rows):
                _forward_call(
                    kernel, q_g[qs], kv_g[ks, 0], kv_g[ks, 1], out_g[qs], lse_g[..., qs],
                    causal, scale, {**kw, **_drop_kw(cx.dropout(step, j))},
                )  # fmt: skip
            del q_g, kv_g, out_g, lse_g  # views keep their bases alive
            if i == len(steps) - 1:
                tail.done(g)  # start this group's combine, finish the one before
        if pending is not None:
            # kv_local is kept for the backward: never a buffer to receive into
            spare = None if kv_cur is kv_local else kv_cur
            kv_cur = pending.wait()
    del kv_cur, spare
    # 4. team combine (``_TailCombine``): global lse from every member's partial lse,
    # rescale, reduce-scatter; sinks join each row's denominator. The accumulators are
    # the combine's now: it frees them once the last group's rows are copied out.
    del acc_out, acc_lse
    out, lse_team = tail.result()
    return out.to(q.dtype), (q_team, kv_local, lse_team)


class _TailCombine:
    """The team combine, head group by head group (``tail_head_groups``).

    ``done(g)`` once group g's heads have all their partial (out, lse): it starts the
    all-gather of their partial lse, then finishes group g-1 (waits its lse, rescales
    its out, starts its reduce-scatter), so group g's lse is in flight while group g+1
    computes and group g-1's out while group g's lse travels. ``result()`` finishes the
    last group and waits the reduce-scatters: (out in member order rows, lse_team).
    C = 1: no collectives; sinks (and nothing else) rescale the rows.
    """

    def __init__(self, cx: RankContext, acc_out: Tensor, acc_lse: Tensor, sinks, heads_kv: int):
        self.cx, self.acc_out, self.acc_lse, self.sinks = cx, acc_out, acc_lse, sinks
        hq = acc_out.shape[2]
        self.groups = tail_head_groups(cx.layout, hq, heads_kv, bool(cx.dropout_p))
        self.lse_h: dict[int, object] = {}
        self.out_h: list = []
        self.lse_team = torch.empty_like(acc_lse)
        self.finished = -1

    def done(self, g: int) -> None:
        if self.cx.layout.team_size > 1:
            qh = self.groups[g][0]
            part = self.acc_lse[:, qh].unsqueeze(0)  # [1, b, hg, n]
            self.lse_h[g] = self.cx.team_comm.all_gather_start(part, "lse")
        if g > 0:
            self._finish(g - 1)

    def _finish(self, g: int) -> None:
        cx, C = self.cx, self.cx.layout.team_size
        qh = self.groups[g][0]
        part_lse = self.acc_lse[:, qh]
        if C > 1:
            lse = torch.logsumexp(self.lse_h.pop(g).wait(), dim=0)  # [b, hg, n]
        else:
            lse = part_lse
        if self.sinks is not None:  # the sink's exp(logit) joins every row's denominator
            sk = self.sinks.to(lse.dtype)[qh]
            lse = torch.logaddexp(lse, sk.view(1, -1, 1))
        out = self.acc_out[:, :, qh]
        if C > 1 or self.sinks is not None:
            safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
            out.mul_(torch.exp(part_lse - safe).permute(2, 0, 1).unsqueeze(-1))
        self.lse_team[:, qh] = lse
        member_order = cx.from_team_order(out)
        del out, part_lse, lse
        if g == len(self.groups) - 1:  # every group copied out: the accumulators are dead
            self.acc_out = self.acc_lse = None
        if C > 1:
            self.out_h.append(cx.team_comm.reduce_scatter_start(member_order, "out"))
        else:
            self.out_h.append(DoneHandle(member_order))
        self.finished = g

    def result(self) -> tuple[Tensor, Tensor]:
        for g in range(self.finished + 1, len(self.groups)):  # done() ran for every group
            self._finish(g)
        parts = [h.wait() for h in self.out_h]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return out, self.lse_team


def _delta_out(dout: Tensor, delta: Tensor) -> Tensor:
    """A stand-in for ``out`` with the same row statistic ``rowsum(dout * out) = delta``.

    Kernels take the backward's D from (dout, out); only D matters, so the team
    rows need not gather the real output. ``dout/|dout| * (delta/|dout|)``:
    by Cauchy-Schwarz its size is at most |out|, and a zero ``dout`` row gives 0.
    """
    acc = delta.dtype
    do = dout.to(acc)
    nrm = torch.linalg.vector_norm(do, dim=-1)  # [n, b, h]
    ok = nrm > 0
    safe = torch.where(ok, nrm, torch.ones_like(nrm))
    scale = torch.where(ok, delta / safe, torch.zeros_like(delta)) / safe
    return (do * scale.unsqueeze(-1)).to(dout.dtype)


class _StepDkv:
    """One sub-ring step's dK/dV sum, fp32 ``[n, 2, b, hkv, d]``, for the K,V held at it.

    From the second computed step on it is the buffer that the previous holder's partial
    sum arrives in (``pending``, started after that step), waited on at the end of the
    step (``get``) as before: the step's calls run while it travels. Their dK/dV
    gradients are kept (in the kernel's dtype) until it has arrived and are then added
    straight into it, so no second team-sized fp32 buffer is needed. A step of one call
    (every step after the first on dense rows) keeps just that call's gradients, alive
    anyway; the last step's head groups keep the first group's while the second computes,
    with no next K,V in flight then; under windows or packed documents a step of several
    calls keeps all of theirs. The first step adds into zeros at once."""

    def __init__(self, pending, like: Tensor, shape: tuple):
        self.pending, self.t, self.kept = pending, None, []
        if pending is None:
            self.t = like.new_zeros(shape)

    def add(self, fn, kh=slice(None)) -> None:
        """``fn(the accumulator's kv heads kh)``: now, or once it has arrived (``get``)."""
        if self.t is None:
            self.kept.append((fn, kh))
        else:
            fn(self.t[:, :, :, kh])

    def get(self) -> Tensor:
        """The accumulator, with every kept gradient added (waits for it the first time)."""
        if self.t is None:
            self.t, self.pending = self.pending.wait(), None
            for fn, kh in self.kept:
                fn(self.t[:, :, :, kh])
            self.kept.clear()
        return self.t

    def rows(self, kh=slice(None), ks=slice(None)):
        """``add`` for one row call: a function of its (g_k, g_v) on kv heads ``kh``, kv
        rows ``ks``."""

        def add_call(g_k: Tensor, g_v: Tensor) -> None:
            def fn(t: Tensor) -> None:
                t[ks, 0] += g_k
                t[ks, 1] += g_v

            self.add(fn, kh)

        return add_call

    def heads(self, kh=slice(None)):
        """``add`` on kv heads ``kh`` (a varlen call's ``dkv``)."""
        return lambda fn: self.add(fn, kh)


def startrail_rank_backward(
    dout: Tensor,
    out: Tensor,
    saved: tuple[Tensor, Tensor, Tensor],
    cx: RankContext,
    scale: float,
    kernel: AttentionKernel,
    sinks: Tensor | None = None,
    joint: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One rank's backward: dq, dk, dv of its local rows, in dout's dtype.

    ``out`` is this rank's forward output and ``saved`` what
    ``startrail_rank_forward`` returned with it, on the same ``cx``. With ``sinks``,
    their gradient from this rank's rows is left in ``cx.sinks_grad`` (the ranks' parts
    sum to the whole, as for any replicated parameter); with ``joint`` keys, theirs in
    ``cx.joint_grad`` alike.
    """
    q_team, kv_local, lse_team = saved
    C = cx.layout.team_size
    s, b, hq, d = dout.shape
    n = C * s
    hkv = kv_local.shape[3]
    acc = acc_dtype(dout.dtype)
    # Team rows' dout and D = rowsum(dout * out), gathered in chunk order, while K,V
    # travels to its first holder (Note [overlap]).
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [s, b, hq]
    do_h = cx.team_comm.all_gather_start(dout, "dout")
    delta_h = cx.team_comm.all_gather_start(delta, "delta")
    steps = cx.steps(s)
    place = cx.initial_placement(kv_local)
    if sinks is not None:  # d sink_h = -sum over this rank's rows of p_sink * D
        lse_mine = _member_rows(cx, lse_team.permute(2, 0, 1), s)  # [s, b, hq]
        p_sink = torch.exp(sinks.to(acc).view(1, 1, hq) - lse_mine)
        cx.sinks_grad = -(p_sink * delta).sum((0, 1))
    do_team = out_eff = None  # gathered at the first step, after its own rows' calls
    split = cx.split_first(hq, hkv)
    kv_cur = cx.team_kv(place)
    del place
    dq = torch.zeros(n, b, hq, d, dtype=acc, device=dout.device)
    dkv_pending = dkv_sent = spare = None  # dkv_sent, spare: buffers reused across steps
    dkv_shape = (n, 2, b, hkv, d)
    # The last step runs head group by head group (``tail_head_groups``): a group's dq is
    # complete once its calls are done, and its reduce-scatter runs while the next group
    # computes (Note [overlap]).
    tail, dq_hs = tail_head_groups(cx.layout, hq, hkv, bool(cx.dropout_p)), []
    for i, step in enumerate(steps):
        pending = cx.ring_step(kv_cur, steps, i, "kv", spare)
        if pending is None:  # the last step receives no K,V: its spare buffer is dead
            spare = None
        dkv = _StepDkv(dkv_pending, dq, dkv_shape)  # the partial sum received, or zeros
        varlen, rows, own = cx.step_calls(step, s, kernel, own_first=split and do_team is None)
        if do_team is None:  # the first step's calls on this rank's own rows, then the rest
            out_mine = _delta_out(dout, delta) if own else None  # local: while the team's
            for qs, ql, ks, causal, kw in own:  # dout and delta arrive
                _backward_call(
                    kernel, dout[ql], q_team[qs], kv_cur[ks], out_mine[ql], lse_team[..., qs],
                    dq[qs], dkv.rows(ks=ks), causal, scale, kw,
                )  # fmt: skip
            del out_mine
            do_team = cx.to_team_order(do_h.wait())
            out_eff = _delta_out(do_team, cx.to_team_order(delta_h.wait()))
            del delta
        last = i == len(steps) - 1
        for g, (qh, kh) in enumerate(tail if last else _ALL_HEADS):
            do_g, q_g, out_g, dq_g = (
                do_team[:, :, qh],
                q_team[:, :, qh],
                out_eff[:, :, qh],
                dq[:, :, qh],
            )
            kv_g, lse_g = kv_cur[:, :, :, kh], lse_team[:, qh]
            for j, call in enumerate(varlen):
                _varlen_backward(
                    kernel, call, do_g, q_g, kv_g, out_g, lse_g, dq_g, dkv.heads(kh), scale,
                    cx.dropout(step, j), cx.softcap,
                )  # fmt: skip
            for j, (qs, ks, causal, kw) in enumerate(rows):
                _backward_call(
                    kernel, do_g[qs], q_g[qs], kv_g[ks], out_g[qs], lse_g[..., qs], dq_g[qs],
                    dkv.rows(kh, ks), causal, scale, {**kw, **_drop_kw(cx.dropout(step, j))},
                )  # fmt: skip
            if last and g < len(tail) - 1:  # these heads' dq is complete: reduce-scatter
                part = cx.from_team_order(dq_g).reshape(C, -1)  # it while the next computes
                dq_hs.append(cx.team_comm.reduce_scatter_start(part, "dq"))
            # views keep their bases alive: none may outlive the step's buffers
            del do_g, q_g, out_g, dq_g, kv_g, lse_g
        # This step's sum goes on; the buffer sent last step (its send done with the
        # receive just waited on) receives the next one.
        total = dkv.get()
        dkv_pending = cx.ring_step(total, steps, i, "dkv", dkv_sent)
        dkv_sent = total
        del dkv, total
        if pending is not None:
            spare = None if kv_cur is kv_local else kv_cur
            kv_cur = pending.wait()
    del kv_cur, out_eff, do_team, spare
    # The held copy's dK/dV goes home, each member its own rows (the buffers of the steps
    # freed first); dq's reduce-scatters run while the parts travel, and the joint keys'
    # part (local rows) is computed meanwhile.
    dkv_pending = cx.send_dkv_home(dkv_sent)
    del dkv_sent
    part = cx.from_team_order(dq[:, :, tail[-1][0]]).reshape(C, -1)  # the last head group
    dq_hs.append(cx.team_comm.reduce_scatter_start(part, "dq"))
    del dq, part
    gq_joint = None
    if joint is not None:
        gq_joint = _joint_backward(cx, dout, out, q_team, lse_team, joint, scale, kernel, acc)
    # This rank's rows of each of its team's C K,V copies' dK/dV, summed in copy order.
    parts = dkv_pending.wait()
    g_kv = parts[0] if C == 1 else parts[0] + parts[1]
    for part in parts[2:]:
        g_kv += part
    del parts
    dq_parts = [h.wait().view(s, b, -1, d) for h in dq_hs]
    g_q = dq_parts[0] if len(dq_parts) == 1 else torch.cat(dq_parts, dim=2)
    del dq_parts
    if gq_joint is not None:
        g_q = g_q + gq_joint
    dt = dout.dtype
    return g_q.to(dt), g_kv[:, 0].to(dt), g_kv[:, 1].to(dt)


class _StarTrailAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, sinks, joint_k, joint_v, groups, causal, scale, kernel, ledger, packed,
        options, comm_options,
    ):  # fmt: skip
        if ledger is not None:
            ledger.phase = "fwd"
        cx = RankContext(
            groups, causal, ledger, packed=packed, options=options, comm_options=comm_options
        )
        joint = None if joint_k is None else (joint_k, joint_v)
        out, saved = startrail_rank_forward(q, k, v, cx, scale, kernel, sinks, joint)
        ctx.save_for_backward(out, *saved, sinks, joint_k, joint_v)
        ctx.cx, ctx.scale, ctx.kernel, ctx.ledger = cx, scale, kernel, ledger
        return out

    @staticmethod
    @once_differentiable  # no double backward: an error, not silently wrong gradients
    def backward(ctx, dout):
        out, q_team, kv_local, lse_team, sinks, joint_k, joint_v = ctx.saved_tensors
        if ctx.ledger is not None:
            ctx.ledger.phase = "bwd"
        joint = None if joint_k is None else (joint_k, joint_v)
        dq, dk, dv = startrail_rank_backward(
            dout.contiguous(), out, (q_team, kv_local, lse_team), ctx.cx, ctx.scale, ctx.kernel,
            sinks, joint,
        )  # fmt: skip
        d_sinks = None if sinks is None else ctx.cx.sinks_grad.to(sinks.dtype)
        d_jk = d_jv = None
        if joint is not None:
            d_jk, d_jv = (g.to(joint_k.dtype) for g in ctx.cx.joint_grad)
        return (dq, dk, dv, d_sinks, d_jk, d_jv) + (None,) * 8


def startrail_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    groups: StarTrailGroups,
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
) -> Tensor:
    """Exact attention over the whole CP-sharded sequence, StarTrail schedule.

    Args:
        q: ``[s_local, b, heads_q, head_dim]``, this CP rank's tokens.
        k, v: ``[s_local, b, heads_kv, head_dim]``; heads_q % heads_kv == 0.
        groups: from ``StarTrailGroups.create`` (same on every CP rank).
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
            window; calls with nothing in it are not made (``block_plan``). A window that
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

    Returns:
        out ``[s_local, b, heads_q, head_dim]`` in q's dtype.
    """
    if not isinstance(groups, StarTrailGroups):
        raise ValueError(
            f"groups must be a StarTrailGroups (StarTrailGroups.create), got {type(groups).__name__}"
        )
    validate_inputs(q, k, v, groups.cp_size, causal)
    packed = packed_layout(groups.cp_size, q.shape[0], cu_seqlens, cu_seqlens_padded)
    opts = check_options(q, groups.cp_size, causal, dropout_p, window, softcap, sinks)
    jk, jv = check_joint_kv(joint_kv, k, causal, opts)
    comm_options = check_comm_options(comm_options, q, groups.own_rows_first)
    kern, scale = resolve_kernel(q, kernel, softmax_scale, **opts.kernel_needs)
    agree_once(
        groups, q, k, bool(causal), packed, opts, sinks is not None,
        joint_tokens=0 if jk is None else jk.shape[0],
    )  # fmt: skip
    return _StarTrailAttention.apply(
        q, k, v, sinks, jk, jv, groups, bool(causal), scale, kern, ledger, packed, opts,
        comm_options,
    )  # fmt: skip
