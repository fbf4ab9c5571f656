"""An alpha-beta cost model of StarTrail and its peers: time, bytes and memory per rank.

Byte counts are never re-derived here: they come from ``accounting``
(StarTrail, ring = C 1, and the peers), the same functions the tests check
against the ledger of real runs. Compute comes
from the kernel calls the implementations make (``block_plan.startrail_step_calls``
on the StarTrail schedule, ``block_plan.allgather_calls``), so causal balance and
the diagonal blocks are counted exactly.

Time of one transfer: ``alpha + bytes / bw`` (Hockney). A P2P step takes
its slowest rank; a link is intra-node or inter-node by the placement, and
the GPUs of a node that send off-node at once share the node's network
bandwidth. A ring collective over n ranks takes ``(n-1) alpha + bytes/bw``
with ``bytes`` the ledger's per-rank volume and ``bw`` its slowest ring edge;
an all-to-all ``(n-1) alpha`` plus its intra-node and inter-node shares.

StarTrail forward = team all-gather q,k,v + initial KV placement + G ring
steps (a pipeline with the schedule's dependencies, ``_ring_pipeline``; with equal
compute, step s: max(compute_s, send KV) with overlap, their sum without) +
team combine (lse all-gather, out reduce-scatter). Backward = dout/delta
all-gather + initial placement + G steps (KV and dK/dV in flight) + the dK/dV
return + dq,dk,dv reduce-scatter. In a layer, the team all-gather overlaps
the QKV projection (paper, sec. 4.3) when the cluster overlaps.
All-gather-KV and Ulysses expose their collectives (no overlap), as their
reference implementations do by default.

Every strategy also pays its elementwise work on buffers (``buffer_bytes``:
copies, reorders, zero-fills, accumulations, casts, counted from the
implementation's tensors) at ``mem_bw``. A layer adds the QKV, output and MLP
GEMMs forward and backward, with the forward rerun under activation recompute;
an iteration (``step_s``) adds the LM head, ZeRO-2's gradient reduce-scatter
and weight all-gather, and the Adam step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Literal

from ..accounting import (
    LocalShape,
    allgather_comm_bytes,
    allgather_comm_calls,
    startrail_comm_bytes,
    startrail_comm_calls,
    ulysses_comm_bytes,
    ulysses_comm_calls,
    ulysses_supported,
)
from ..block_plan import allgather_calls, startrail_step_calls, team_chunk_len
from ..layout import PLACEMENTS, Placement, StarTrailLayout, valid_team_sizes
from .cluster import ClusterSpec, ModelSpec

__all__ = [
    "AttnShape",
    "Prediction",
    "Strategy",
    "StrategyKind",
    "buffer_bytes",
    "candidate_strategies",
    "comm_bytes",
    "kv_stream_bytes",
    "memory_bytes",
    "paper_comm_bytes",
    "paper_memory_units",
    "predict",
]

StrategyKind = Literal["startrail", "allgather", "ulysses"]
STRATEGY_KINDS: tuple[str, ...] = ("startrail", "allgather", "ulysses")


@dataclass(frozen=True)
class Strategy:
    """One way to run context-parallel attention."""

    kind: StrategyKind
    team_size: int = 1
    """StarTrail's C (1 = ring attention); 1 for the peers."""
    placement: Placement = "team"
    """StarTrail's placement; ignored by the peers."""

    def __post_init__(self) -> None:
        if self.kind not in STRATEGY_KINDS:
            raise ValueError(f"strategy kind={self.kind!r} is not known; allowed: {STRATEGY_KINDS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not known; allowed: {PLACEMENTS}")

    @property
    def name(self) -> str:
        if self.kind != "startrail":
            return self.kind
        if self.team_size == 1:
            return "ring"
        return f"startrail-C{self.team_size}-{self.placement}"


@dataclass(frozen=True)
class AttnShape:
    """The attention one CP group runs (Megatron layout, per rank)."""

    cp_size: int
    s_local: int
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    elem_bytes: int = 2
    """Input dtype bytes (bf16: 2)."""
    acc_bytes: int = 4
    """Accumulation dtype bytes (fp32: 4; fp64 runs: 8)."""
    causal: bool = True

    def __post_init__(self) -> None:
        for f in ("cp_size", "s_local", "batch", "heads_q", "heads_kv", "head_dim", "elem_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}={v!r} must be an integer >= 1")
        if self.causal and self.s_local % 2:
            raise ValueError(
                f"causal zigzag needs an even s_local (sequence / cp_size), got {self.s_local}"
            )

    @classmethod
    def for_model(
        cls, model: ModelSpec, seq_len: int, cp_size: int, batch: int = 1, **kw
    ) -> AttnShape:
        if seq_len % (2 * cp_size):
            raise ValueError(
                f"seq_len={seq_len} must be divisible by 2*cp_size = {2 * cp_size} (zigzag)"
            )
        return cls(
            cp_size, seq_len // cp_size, batch, model.heads, model.kv_heads, model.head_dim, **kw
        )

    @property
    def seq_len(self) -> int:
        return self.s_local * self.cp_size

    @property
    def local(self) -> LocalShape:
        """One rank's tensors, the shape argument of ``accounting``."""
        return LocalShape(
            self.s_local,
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            self.elem_bytes,
            self.acc_bytes,
        )


def candidate_strategies(cp_size: int, heads_q: int, heads_kv: int) -> list[Strategy]:
    """StarTrail for every valid C and distinct placement (C = 1 is ring), then the peers.

    A placement is listed once when both give the same rank map (C = 1 and C*C = P).
    """
    out: list[Strategy] = []
    for c in valid_team_sizes(cp_size):
        seen: set[tuple] = set()
        for pl in PLACEMENTS:
            lay = StarTrailLayout(cp_size, c, pl)
            key = tuple(lay.coord(r) for r in range(cp_size))
            if key not in seen:
                seen.add(key)
                out.append(Strategy("startrail", c, pl))
    out.append(Strategy("allgather"))
    if ulysses_supported(cp_size, heads_q, heads_kv):
        out.append(Strategy("ulysses"))
    return out


# ---- bytes ------------------------------------------------------------------
def comm_bytes(strategy: Strategy, shape: AttnShape) -> list[dict[str, int]]:
    """Per rank: ``fwd_p2p``, ``bwd_p2p``, ``fwd_collective``, ``bwd_collective`` bytes sent."""
    p = shape.cp_size
    if strategy.kind == "startrail":
        lay = StarTrailLayout(p, strategy.team_size, strategy.placement)
        return [
            startrail_comm_bytes(lay.team_size, lay.p2p_sends(r, backward=True), shape.local)
            for r in range(p)
        ]
    fn = allgather_comm_bytes if strategy.kind == "allgather" else ulysses_comm_bytes
    return [fn(p, shape.local)] * p


def comm_calls(strategy: Strategy, shape: AttnShape) -> list[dict[str, int]]:
    """Per rank: communication calls, same keys as ``comm_bytes``."""
    p = shape.cp_size
    if strategy.kind == "allgather":
        return [allgather_comm_calls(p)] * p
    if strategy.kind == "ulysses":
        return [ulysses_comm_calls(p)] * p
    lay = StarTrailLayout(p, strategy.team_size, strategy.placement)
    return [startrail_comm_calls(lay.team_size, lay.p2p_sends(r, backward=True)) for r in range(p)]


def paper_comm_bytes(
    seq_len: int, hidden: int, cp_size: int, team_size: int, batch: int = 1, elem_bytes: int = 2
) -> dict[str, float]:
    """The paper's per-rank forward volumes (eqs. 4-7), in bytes.

    ring ``2BNH`` (K and V of the whole sequence, P steps), StarTrail P2P
    ``2BNH/C``, StarTrail team collectives ``4BNH(C-1)/P`` (q, k, v gathered,
    out reduce-scattered, all in the input dtype).
    """
    bnh = batch * seq_len * hidden * elem_bytes
    return {
        "ring_p2p": 2 * bnh,
        "startrail_p2p": 2 * bnh / team_size,
        "startrail_collective": 4 * bnh * (team_size - 1) / cp_size,
    }


# ---- links ------------------------------------------------------------------
def _inter_bw(cl: ClusterSpec, senders: int) -> float:
    """Inter-node bandwidth of one GPU while ``senders`` GPUs of its node send off-node."""
    return min(cl.inter_bw_per_gpu, cl.inter_bw / max(senders, 1))


def _p2p_step(cl: ClusterSpec, sends: list[tuple[int, int, int]]) -> float:
    """One P2P step, every (src, dst, bytes) at once: the slowest sender's time."""
    off: dict[int, int] = {}
    for s, d, b in sends:
        if b and cl.node(s) != cl.node(d):
            off[cl.node(s)] = off.get(cl.node(s), 0) + 1
    t = 0.0
    for s, d, b in sends:
        if not b or s == d:
            continue
        if cl.node(s) == cl.node(d):
            t = max(t, cl.intra_latency + b / cl.intra_bw)
        else:
            t = max(t, cl.inter_latency + b / _inter_bw(cl, off[cl.node(s)]))
    return t


def _collective(cl: ClusterSpec, groups: list[list[int]], nbytes: int, calls: int) -> float:
    """Ring collectives on every group at once; ``nbytes`` = per-rank volume sent."""
    if not nbytes:
        return 0.0
    off: dict[int, int] = {}
    edges = []
    for g in groups:
        n = len(g)
        e = [(g[i], g[(i + 1) % n]) for i in range(n)] if n > 1 else []
        edges.append(e)
        for s, d in e:
            if cl.node(s) != cl.node(d):
                off[cl.node(s)] = off.get(cl.node(s), 0) + 1
    t = 0.0
    for g, e in zip(groups, edges):
        if not e:
            continue
        inter = [s for s, d in e if cl.node(s) != cl.node(d)]
        bw = min([cl.intra_bw] + [_inter_bw(cl, off[cl.node(s)]) for s in inter])
        alpha = cl.inter_latency if inter else cl.intra_latency
        t = max(t, calls * (len(g) - 1) * alpha + nbytes / bw)
    return t


def _all_to_all(cl: ClusterSpec, p: int, nbytes: int, calls: int) -> float:
    """All-to-all over CP ranks 0..p-1; ``nbytes`` = per-rank volume sent."""
    if p == 1 or not nbytes:
        return 0.0
    local = min(cl.gpus_per_node, p)
    n_in, n_out = local - 1, p - local
    per_peer = nbytes / (p - 1)
    t_in = n_in * per_peer / cl.intra_bw
    t_out = n_out * per_peer / _inter_bw(cl, local) if n_out else 0.0
    return calls * (n_in * cl.intra_latency + n_out * cl.inter_latency) + max(t_in, t_out)


# ---- compute ----------------------------------------------------------------
CallShape = tuple[int, int, bool]
"""One kernel call in tokens: (q rows, kv rows, causal)."""


@lru_cache(maxsize=256)
def _startrail_call_shapes(
    lay: StarTrailLayout, causal: bool, s_local: int
) -> tuple[tuple[tuple[CallShape, ...], ...], ...]:
    """[step][rank] -> the calls of ``block_plan.startrail_step_calls``, in tokens."""
    chunk = team_chunk_len(lay, s_local, causal)
    return tuple(
        tuple(
            tuple(
                ((x.q_hi - x.q_lo) * chunk, (x.kv_hi - x.kv_lo) * chunk, x.causal)
                for x in startrail_step_calls(lay, r, step, causal)
            )
            for r in range(lay.cp_size)
        )
        for step in range(lay.ring_size)
    )


def _allgather_call_shapes(rank: int, shape: AttnShape) -> tuple[CallShape, ...]:
    """The calls of ``block_plan.allgather_calls``, in tokens."""
    calls = allgather_calls(rank, shape.cp_size, shape.causal, shape.s_local)
    return tuple((qs.stop - qs.start, ks.stop - ks.start, cz) for qs, ks, cz in calls)


def _call_work(shapes: tuple[CallShape, ...]) -> tuple:
    """((full pairs, causal pairs, causal rows) per (batch, head), calls, ``shapes``)."""
    full = sum(nq * nk for nq, nk, cz in shapes if not cz)
    diag = sum(nq * (nq + 1) // 2 for nq, nk, cz in shapes if cz)
    rows = sum(nq for nq, nk, cz in shapes if cz)
    return (full, diag, rows), len(shapes), shapes


@lru_cache(maxsize=256)
def _startrail_work(lay: StarTrailLayout, causal: bool, s_local: int) -> tuple:
    """[step][rank] -> ``_call_work`` of that rank's calls at that step."""
    steps = _startrail_call_shapes(lay, causal, s_local)
    return tuple(tuple(_call_work(calls) for calls in row) for row in steps)


def kv_stream_bytes(
    nq: int,
    nk: int,
    causal: bool,
    *,
    cache_bytes: float,
    q_blocks: tuple[tuple[int, int], ...],
    batch: int,
    heads_q: int,
    head_dim: int,
    elem_bytes: int,
    grad_bytes: int,
    bwd: bool,
) -> float:
    """Bytes one kernel call re-streams because its per-head K,V do not fit in the cache.

    A flash-style kernel walks, for each query block of each (batch, q head), over all
    the key blocks. When one head's K,V (forward) or K,V,dK,dV (backward; dK,dV of
    ``grad_bytes`` per element: PyTorch's CPU kernel keeps them in the input dtype)
    exceed ``cache_bytes``, every query block reads them again from further away: K and
    V once per query block forward; K, V read and dK, dV read and written backward.
    ``q_blocks``: the kernel's query block size by query length
    (``ClusterSpec.kernel_q_blocks``). A causal diagonal call touches half the key blocks
    on average (an upper bound: early query blocks stop at their own keys). 0 when the
    term is off (no cache size or blocks), the call is empty or the working set fits.
    """
    if not cache_bytes or not q_blocks or nq <= 0 or nk <= 0:
        return 0.0
    kv = nk * head_dim * elem_bytes  # one head's K (or V)
    dkv = nk * head_dim * grad_bytes
    if (2 * kv + (2 * dkv if bwd else 0)) <= cache_bytes:
        return 0.0
    block = next((b for lo, b in q_blocks if nq >= lo), q_blocks[-1][1])
    passes = batch * heads_q * -(-nq // min(block, nq))
    per_pass = 2 * kv + (4 * dkv if bwd else 0)
    return passes * per_pass * (0.5 if causal else 1.0)


def _kernel_time(
    cl: ClusterSpec,
    shape: AttnShape,
    pairs: tuple[int, int, int],
    calls: int,
    bwd: bool,
    shapes: tuple[tuple[int, int, bool], ...] = (),
) -> float:
    """Kernel time of (full pairs, causal-diagonal pairs, causal rows) in ``calls`` calls.

    A causal call also computes the masked part of its diagonal tiles:
    ``causal_tile_waste`` extra pairs per query row. ``shapes``: the calls' (q rows,
    kv rows, causal), for the K,V re-streaming of calls too long for the cache
    (``kv_stream_bytes``, at ``kv_stream_bw`` / ``kv_stream_bw_bwd``).
    """
    per_pair = 4 * shape.head_dim * shape.heads_q * shape.batch
    full, diag, rows = pairs
    work = full + diag + rows * cl.causal_tile_waste
    t = calls * cl.kernel_overhead + per_pair * work / cl.attn_flops
    t = t * cl.attn_bwd_ratio if bwd else t
    bw = cl.kv_stream_bw_bwd if bwd else cl.kv_stream_bw
    if bw and shapes:
        dims = dict(
            cache_bytes=cl.kernel_cache_bytes,
            q_blocks=cl.kernel_q_blocks,
            batch=shape.batch,
            heads_q=shape.heads_q,
            head_dim=shape.head_dim,
            elem_bytes=shape.elem_bytes,
            grad_bytes=shape.elem_bytes,
            bwd=bwd,
        )
        t += sum(kv_stream_bytes(nq, nk, cz, **dims) for nq, nk, cz in shapes) / bw
    return t


def _ring_pipeline(
    cl: ClusterSpec,
    comp: list[list[float]],
    prev: list[int],
    x_kv: float,
    x_dkv: float = 0.0,
) -> float:
    """Makespan of the sub-ring steps with the schedule's real dependencies.

    ``comp[s][r]``: rank r's kernel time at step s; ``prev[r]``: its ring predecessor.
    A transfer completes ``x`` after both its ends have posted it, and a rank's wait
    covers its send and its receive (``P2PHandle.wait``). Forward (``attention._forward``):
    rank r posts the next KV exchange when it starts step s-1, and starts step s once it
    has finished step s-1 and that exchange (KV to its successor, from its predecessor)
    is done. Backward (``x_dkv > 0``, ``_backward``): KV travels as in the forward; after
    computing step s, rank r waits for the dK/dV exchange it posted when it ended step
    s-1 (its partial to the successor, the predecessor's to it), adds it, and posts the
    next. Ranks thus do not meet at every step: a rank that holds a causal diagonal
    block at one step and full blocks at the others pays its own sum, not the per-step
    maximum over ranks. Without ``cl.overlap`` the transfers take the ranks' own time
    (gloo's threads share the cores): each step but the last costs compute +
    ``max(x_kv, x_dkv)``, and a transfer is done once both its ends have posted it (its
    time is in their steps already). With equal compute everywhere the makespan is
    exactly ``sum_s max(compute_s, transfer_s)`` with overlap, ``sum_s (compute_s +
    transfer_s)`` without.
    """
    g, p = len(comp), len(comp[0])
    nxt = [0] * p
    for r, q in enumerate(prev):
        nxt[q] = r

    def done(posted: list[float], r: int, x: float) -> float:
        return max(posted[prev[r]], posted[r], posted[nxt[r]]) + (x if cl.overlap else 0.0)

    own = max(x_kv, x_dkv)
    start, end = [0.0] * p, [0.0] * p
    for s in range(g):
        if s > 0:
            start = [max(end[r], done(start, r, x_kv)) for r in range(p)]
        busy = 0.0 if cl.overlap or s == g - 1 else own
        new_end = [start[r] + comp[s][r] + busy for r in range(p)]
        if s > 0 and x_dkv:
            new_end = [max(new_end[r], done(end, r, x_dkv)) for r in range(p)]
        end = new_end
    return max(end)


# ---- elementwise work on buffers ---------------------------------------------
def _startrail_rows(lay: StarTrailLayout, causal: bool, s_local: int) -> tuple:
    """[rank] -> (q rows, kv rows) summed over this rank's kernel calls of every step (tokens)."""
    steps = _startrail_call_shapes(lay, causal, s_local)
    return tuple(
        (
            sum(nq for row in steps for nq, _, _ in row[r]),
            sum(nk for row in steps for _, nk, _ in row[r]),
        )
        for r in range(lay.cp_size)
    )


def buffer_bytes(
    strategy: Strategy, shape: AttnShape, *, rs_via_allreduce: bool = False
) -> tuple[int, int]:
    """(forward, backward) bytes read + written per rank by the tensor ops outside the
    kernels and the communication, max over ranks, counted from the implementation's buffers.

    A copy (reorder, ``cat``, ``stack``, ``contiguous``, a permute) of X bytes moves 2X, a
    zero-fill X, an accumulation ``acc[rows] += g`` reads and writes ``acc`` and reads ``g``,
    a dtype cast reads one dtype and writes the other (nothing when the dtypes agree).
    A reduce-scatter over n ranks adds its reductions: ``n-1`` sums of one output-sized
    chunk (a ring reduce-scatter), 3 (n-1) output bytes; ``rs_via_allreduce`` (gloo:
    clone, all-reduce, copy out) adds the clone of the input and the copy of the output.
    The all-gathered buffers' own writes are the collectives' (calibrated with them); the
    merges after each forward call are the kernel's (calibrated with it); row statistics
    (lse, delta: 1/head_dim of the tensors beside them) are left out.

    All-gather-KV works on full-sequence buffers: the gathered K,V reordered into chunk
    order (forward and again in the backward), the fp32 dK/dV accumulator over the whole
    sequence, its reorder back and the reduce-scatter's reductions of it; StarTrail and ring
    on team buffers (C times the local size); Ulysses copies each all-to-all'd tensor once
    (DeepSpeed's permute) and reorders the gathered sequence into natural order.
    """
    p, e, a = shape.cp_size, shape.elem_bytes, shape.acc_bytes
    rq = shape.batch * shape.heads_q * shape.head_dim  # elements of one q row
    rkv = shape.batch * shape.heads_kv * shape.head_dim  # one k (or v) row
    uq, ukv = shape.s_local * rq, shape.s_local * rkv
    conv = 0 if e == a else a + e  # bytes per element of a cast

    def rs(n: int, out_elems: int) -> int:  # a reduce-scatter's reductions (+ gloo's copies)
        return (3 * (n - 1) + (2 * n + 2 if rs_via_allreduce else 0)) * out_elems * a

    if strategy.kind == "ulysses":
        moved = (2 * uq + 2 * ukv) * e  # q, k, v, out (forward); dout, dq, dk, dv (backward)
        each = 2 * moved * (2 if shape.causal else 1)  # DeepSpeed's permute (+ our reorder)
        return each, each
    if strategy.kind == "allgather":
        full = p * 2 * ukv  # the gathered K,V
        fwd = bwd = 0
        for r in range(p):
            calls = _allgather_call_shapes(r, shape)
            qr = sum(nq for nq, _, _ in calls)
            kr = sum(nk for _, nk, _ in calls)
            reord = 2 * full * e if shape.causal and p > 1 else 0
            f = 4 * ukv * e + reord + uq * a + uq * conv  # stack, reorder, out zeros, cast
            b = 4 * ukv * e + reord + uq * a + full * a  # stack, reorder, dq and dK/dV zeros
            b += (qr * rq + 2 * kr * rkv) * (2 * a + e)  # dq[qs] += g_q, dkv[ks] += g_k, g_v
            if shape.causal and p > 1:
                b += 2 * full * a  # dK/dV back to rank order
            b += rs(p, full // p) + (uq + 2 * ukv) * conv
            fwd, bwd = max(fwd, f), max(bwd, b)
        return fwd, bwd
    c = strategy.team_size
    lay = StarTrailLayout(p, c, strategy.placement)
    reord = shape.causal and c > 1  # the team's [fronts, backs] order (identity for C = 1)
    rows = _startrail_rows(lay, shape.causal, shape.s_local)
    g = lay.ring_size
    f = 4 * ukv * e  # stack k,v
    if c > 1:  # cat q with it; reorder; the q and K,V copies out of the gathered buffer
        f += 2 * (uq + 2 * ukv) * e + (2 * c * (uq + 2 * ukv) * e if reord else 0)
        f += 2 * c * (uq + 2 * ukv) * e
    f += c * uq * a  # output accumulator zeros
    if c > 1:
        f += 2 * c * uq * a + (2 * c * uq * a if reord else 0) + rs(c, uq)  # rescale, reorder
    f += uq * conv
    b0 = 4 * uq * a + 2 * uq * conv  # delta = rowsum(dout * out)
    b0 += 2 * c * uq * e if reord else 0  # team dout reorder
    b0 += 3 * c * uq * a + 2 * c * uq * conv  # the out stand-in
    b0 += c * uq * a + g * c * 2 * ukv * a + (g - 1) * 3 * c * 2 * ukv * a  # zeros; dkv += recv
    b0 += 2 * c * (uq + 2 * ukv) * a * (2 if reord else 1)  # reorders back; cat
    b0 += (rs(c, uq + 2 * ukv) if c > 1 else 0) + (uq + 2 * ukv) * conv
    bwd = max(b0 + (qr * rq + 2 * kr * rkv) * (2 * a + e) for qr, kr in rows)
    return f, bwd


def _reduce_scatter_extra(cl: ClusterSpec, groups: list[list[int]], nbytes: int) -> float:
    """What a reduce-scatter of ``nbytes`` (ledger volume) costs beyond a ring collective of
    that volume: on gloo (an all-reduce of the whole input) as much again."""
    return _collective(cl, groups, nbytes, 1) if cl.reduce_scatter_via_allreduce else 0.0


def _buffer_time(cl: ClusterSpec, nbytes: int) -> float:
    return nbytes / cl.mem_bw if cl.mem_bw > 0 else 0.0


# ---- memory -----------------------------------------------------------------
def paper_memory_units(strategy: Strategy, layers: int) -> int:
    """Activation memory in units of A = BNH/P (paper, eqs. 8-10), beyond model states M.

    Ring / all-gather / Ulysses: Y + 4; StarTrail: Y + 3C + 1.
    """
    c = strategy.team_size if strategy.kind == "startrail" else 1
    return layers + 3 * c + 1 if c > 1 else layers + 4


def memory_bytes(
    strategy: Strategy, shape: AttnShape, model: ModelSpec, zero_shards: int | None = None
) -> dict[str, float]:
    """Peak memory per rank, refined from real tensor sizes (GQA included).

    ``model_states``: bf16 weights (replicated), bf16 gradients and fp32
    master weights and Adam moments (12 bytes/param) sharded over
    ``zero_shards`` ranks (ZeRO-2 over the CP group by default, as in the paper). ``checkpoints``: one layer input
    ``[s, b, H]`` per layer (full activation checkpointing). ``layer``: the
    layer recomputed in the backward, its MLP intermediates, and the
    attention's working set at its peak (the backward) for this strategy.
    """
    p = shape.cp_size
    zero = zero_shards or p
    e, a = shape.elem_bytes, shape.acc_bytes
    tok = shape.s_local * shape.batch
    uq = tok * shape.heads_q * shape.head_dim  # one local q (or out) tensor, elements
    ukv = tok * shape.heads_kv * shape.head_dim  # one local k (or v)
    h = model.hidden
    states = model.params * 2 + model.params * (2 + 12) / zero
    checkpoints = model.layers * tok * h * e
    dense = tok * (3 * h + 2 * model.ffn_hidden) * e  # ln/qkv/proj outputs, MLP intermediates
    local = (2 * uq + 2 * ukv) * e * 2  # q, k, v, out and their gradients
    c = strategy.team_size
    if strategy.kind == "startrail":
        n = c  # team tokens / local tokens
        work = (
            n * (uq + 2 * ukv) * e  # team q, k, v (saved)
            + n * tok * shape.heads_q * a  # team lse
            + 2 * n * uq * e  # team dout and the out stand-in
            + 2 * n * 2 * ukv * e  # KV in use + KV in flight
            + n * uq * a  # dq accumulator
            + 2 * n * 2 * ukv * a  # dK/dV in use + in flight
            + n * (uq + 2 * ukv) * a  # the dq,dk,dv reduce-scatter buffer
        )
    elif strategy.kind == "allgather":
        work = p * 2 * ukv * e * 2 + p * 2 * ukv * a + tok * shape.heads_q * a + uq * a
    else:  # ulysses: whole sequence, heads/P; the same element counts as local tensors
        work = (2 * uq + 2 * ukv) * e * 2 + (uq + 2 * ukv) * a + tok * shape.heads_q * a
    total = states + checkpoints + dense + local + work
    return {
        "model_states": states,
        "checkpoints": checkpoints,
        "layer": dense + local + work,
        "attention_work": work,
        "total": total,
    }


# ---- prediction -------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    strategy: str
    team_size: int
    placement: str
    attn_fwd_s: float
    attn_bwd_s: float
    attn_s: float
    """Attention forward + backward of one layer, nothing overlapped with the projections."""
    layer_s: float
    """One transformer layer forward + backward (the forward twice with activation
    recompute), team all-gather overlapped with QKV."""
    step_s: float
    """One training iteration: all layers, the LM head, the ZeRO-2 gradient
    reduce-scatter and parameter all-gather, the optimizer (``grad_sync_s`` and the rest)."""
    grad_sync_s: float
    """ZeRO-2 gradient reduce-scatter + parameter all-gather over the CP group (exposed)."""
    p2p_bytes: int
    """Max over ranks of P2P bytes sent, forward + backward."""
    collective_bytes: int
    """Max over ranks of collective bytes sent, forward + backward."""
    fwd_p2p_bytes: int
    fwd_collective_bytes: int
    memory_bytes: float
    fits: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _dense_flops(model: ModelSpec, tokens: int) -> tuple[float, float]:
    """(QKV projection, everything else dense) forward FLOPs for ``tokens`` tokens."""
    h, kv = model.hidden, model.kv_heads * model.head_dim
    qkv = 2 * tokens * h * (h + 2 * kv)
    rest = 2 * tokens * (h * h + (3 if model.gated_mlp else 2) * h * model.ffn_hidden)
    return qkv, rest


ADAM_BYTES_PER_PARAM = 28
"""Bytes an Adam step reads + writes per parameter (ZeRO-2 shard): fp32 master, m and v
read and written (24), the bf16 gradient read (2) and the bf16 weight written (2)."""


def _iteration_extra(cl: ClusterSpec, model: ModelSpec, shape: AttnShape) -> tuple[float, float]:
    """(ZeRO-2 gradient + parameter collectives, LM head + optimizer) seconds per iteration.

    Per iteration (batch 1: one micro-batch): ZeRO-2 over the CP group reduce-scatters the
    gradients and all-gathers the updated weights, both in the input dtype, each rank
    sending ``(P-1)/P`` of the model. NCCL runs such a large collective on several rings
    (one channel per NIC rail), so across nodes it reaches the node's ``inter_bw``, not one
    GPU's rail. Exposed: DeepSpeed's ZeRO-2 default ``overlap_comm=False``. The LM head
    (``2 t H V`` FLOPs forward, twice that backward) at ``matmul_flops``; the Adam step on
    this rank's ``params/P`` shard at ``mem_bw``.
    """
    p, e = shape.cp_size, shape.elem_bytes
    tokens = shape.s_local * shape.batch
    sync = 0.0
    if p > 1:
        multi = p > cl.gpus_per_node
        bw = min(cl.intra_bw, cl.inter_bw) if multi else cl.intra_bw
        alpha = cl.inter_latency if multi else cl.intra_latency
        nbytes = (p - 1) * model.params * e / p
        sync = 2 * ((p - 1) * alpha + nbytes / bw)
    head = 3 * 2 * tokens * model.hidden * model.vocab / cl.matmul_flops
    optim = _buffer_time(cl, model.params / p * ADAM_BYTES_PER_PARAM)
    return sync, head + optim


def _startrail_times(st: Strategy, cl: ClusterSpec, shape: AttnShape):
    """(fwd, bwd, team all-gather of q,k,v) seconds for StarTrail / ring."""
    p = shape.cp_size
    lay = StarTrailLayout(p, st.team_size, st.placement)
    byts = comm_bytes(st, shape)
    no_acc = replace(shape.local, acc_bytes=0)  # the q,k,v all-gather: input dtype only
    qkv = max(
        startrail_comm_bytes(lay.team_size, lay.p2p_sends(r, backward=True), no_acc)[
            "fwd_collective"
        ]
        for r in range(p)
    )
    teams = lay.all_team_ranks()
    team_kv = st.team_size * 2 * shape.s_local * shape.batch * shape.heads_kv * shape.head_dim
    kv_msg = team_kv * shape.elem_bytes
    dkv_msg = team_kv * shape.acc_bytes
    work = _startrail_work(lay, shape.causal, shape.s_local)
    g = lay.ring_size

    def init_step() -> float:
        return _p2p_step(cl, [(r, lay.initial_send_peer(r), kv_msg) for r in range(p)])

    def ring_step(msg: int) -> float:
        return _p2p_step(cl, [(r, lay.ring_next(r), msg) for r in range(p)])

    def comp(bwd: bool) -> list[list[float]]:
        return [[_kernel_time(cl, shape, pr, nc, bwd, sh) for pr, nc, sh in row] for row in work]

    prev = [lay.ring_prev(r) for r in range(p)]

    # Forward
    t_qkv = _collective(cl, teams, qkv, 1)
    fwd_coll = max(b["fwd_collective"] for b in byts)
    t_comb = _collective(cl, teams, fwd_coll - qkv, 2)
    uq = shape.s_local * shape.batch * shape.heads_q * shape.head_dim
    ukv = shape.s_local * shape.batch * shape.heads_kv * shape.head_dim
    c1 = st.team_size - 1
    t_comb += _reduce_scatter_extra(cl, teams, c1 * uq * shape.acc_bytes)  # out
    fwd = t_qkv + init_step() + t_comb
    fwd += _ring_pipeline(cl, comp(False), prev, ring_step(kv_msg) if g > 1 else 0.0)
    # Backward
    bwd_coll = max(b["bwd_collective"] for b in byts)
    bwd = _collective(cl, teams, bwd_coll, 3) + init_step()
    bwd += _reduce_scatter_extra(cl, teams, c1 * (uq + 2 * ukv) * shape.acc_bytes)  # dq,dk,dv
    x = ring_step(kv_msg + dkv_msg) if g > 1 else 0.0  # KV and dK/dV share the link
    bwd += _ring_pipeline(cl, comp(True), prev, x, x)
    ret = [(r, lay.dkv_return_peers(r)[0], dkv_msg) for r in range(p)]
    bwd += _p2p_step(cl, ret)
    return fwd, bwd, t_qkv


def _peer_times(st: Strategy, cl: ClusterSpec, shape: AttnShape):
    p = shape.cp_size
    b = comm_bytes(st, shape)[0]
    everyone = [list(range(p))]
    if st.kind == "allgather":
        work = [_call_work(_allgather_call_shapes(r, shape)) for r in range(p)]
        fwd_c = max(_kernel_time(cl, shape, pr, n, False, sh) for pr, n, sh in work)
        bwd_c = max(_kernel_time(cl, shape, pr, n, True, sh) for pr, n, sh in work)
        fwd = _collective(cl, everyone, b["fwd_collective"], 1) + fwd_c
        bwd = _collective(cl, everyone, b["bwd_collective"], 2) + bwd_c
        dkv = (p - 1) * 2 * shape.s_local * shape.batch * shape.heads_kv * shape.head_dim
        bwd += _reduce_scatter_extra(cl, everyone, dkv * shape.acc_bytes)
        return fwd, bwd, 0.0
    n = shape.seq_len
    pairs = (0, n * (n + 1) // 2, n) if shape.causal else (n * n, 0, 0)
    local = (
        AttnShape(
            p,
            shape.s_local,
            shape.batch,
            shape.heads_q // p,
            shape.heads_kv // p,
            shape.head_dim,
            shape.elem_bytes,
            shape.acc_bytes,
            shape.causal,
        )
        if p > 1
        else shape
    )
    whole = ((n, n, shape.causal),)
    fwd = _all_to_all(cl, p, b["fwd_collective"], 4)
    fwd += _kernel_time(cl, local, pairs, 1, False, whole)
    bwd = _all_to_all(cl, p, b["bwd_collective"], 4)
    bwd += _kernel_time(cl, local, pairs, 1, True, whole)
    return fwd, bwd, 0.0


def predict(
    strategy: Strategy,
    cluster: ClusterSpec,
    shape: AttnShape,
    model: ModelSpec | None = None,
    *,
    recompute: bool = True,
) -> Prediction:
    """Predicted time, bytes and memory per rank of one strategy on one cluster.

    Without ``model`` the layer is attention only (no projections, no MLP, no
    iteration terms) and memory counts the attention's working set alone.
    ``recompute``: full activation checkpointing, as ``memory_bytes`` assumes (the
    paper's eqs. 8-10): the backward first reruns the layer's forward, attention and
    its communication included.
    """
    if shape.cp_size > cluster.num_gpus:
        raise ValueError(
            f"cp_size={shape.cp_size} exceeds the cluster's {cluster.num_gpus} GPUs "
            f"({cluster.num_nodes} nodes x {cluster.gpus_per_node})"
        )
    if strategy.kind == "ulysses" and not ulysses_supported(
        shape.cp_size, shape.heads_q, shape.heads_kv
    ):
        raise ValueError(
            f"Ulysses needs heads_q ({shape.heads_q}) and heads_kv ({shape.heads_kv}) divisible "
            f"by cp_size {shape.cp_size}"
        )
    if strategy.kind == "startrail":
        fwd, bwd, t_qkv = _startrail_times(strategy, cluster, shape)
    else:
        fwd, bwd, t_qkv = _peer_times(strategy, cluster, shape)
    buf_f, buf_b = buffer_bytes(
        strategy, shape, rs_via_allreduce=cluster.reduce_scatter_via_allreduce
    )
    fwd += _buffer_time(cluster, buf_f)
    bwd += _buffer_time(cluster, buf_b)
    attn = fwd + bwd
    layer, mem, step, sync = attn, None, attn, 0.0
    if model is not None:
        qkv_f, rest_f = _dense_flops(model, shape.s_local * shape.batch)
        t_qkvp, t_rest = qkv_f / cluster.matmul_flops, rest_f / cluster.matmul_flops
        hidden_ag = min(t_qkv, t_qkvp) if cluster.overlap else 0.0
        layer_fwd = fwd + t_qkvp + t_rest - hidden_ag
        passes = 2 if recompute else 1
        layer = passes * layer_fwd + bwd + 2 * (t_qkvp + t_rest)  # dense backward = 2x forward
        mem = memory_bytes(strategy, shape, model)["total"]
        sync, other = _iteration_extra(cluster, model, shape)
        step = model.layers * layer + sync + other
    else:
        model_free = ModelSpec(
            "attn", 1, shape.heads_q * shape.head_dim, shape.heads_q, shape.heads_kv, 1, vocab=1
        )
        mem = memory_bytes(strategy, shape, model_free)["attention_work"]
    byts = comm_bytes(strategy, shape)
    return Prediction(
        strategy=strategy.name,
        team_size=strategy.team_size,
        placement=strategy.placement
        if strategy.kind == "startrail" and strategy.team_size > 1
        else "-",
        attn_fwd_s=fwd,
        attn_bwd_s=bwd,
        attn_s=attn,
        layer_s=layer,
        step_s=step,
        grad_sync_s=sync,
        p2p_bytes=max(b["fwd_p2p"] + b["bwd_p2p"] for b in byts),
        collective_bytes=max(b["fwd_collective"] + b["bwd_collective"] for b in byts),
        fwd_p2p_bytes=max(b["fwd_p2p"] for b in byts),
        fwd_collective_bytes=max(b["fwd_collective"] for b in byts),
        memory_bytes=mem,
        fits=mem <= cluster.gpu_memory,
    )
