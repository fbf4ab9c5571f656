"""An alpha-beta cost model of StarTrail and its peers: time, bytes and memory per rank.

``predict`` sums the pieces, each in its own module: bytes from ``accounting``
(the same functions the tests check against the ledger of real runs), link
timing (``links``), kernel time (``compute``), the attention's forward and
backward (``times``), elementwise buffer work (``buffers``) and memory
(``memory``); the strategies are declared in ``strategies``.

A layer adds the QKV, output and MLP GEMMs forward and backward, with the
forward rerun under activation recompute. The paper (sec. 4.3) hides the team
all-gather behind the QKV projection; our adapters receive q, k, v after that
projection, so no code does that and the model does not assume it (the overlaps
it does charge are in ``times``). An
iteration (``step_s``) adds the LM head, ZeRO-2's gradient reduce-scatter and
weight all-gather, and the Adam step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .buffers import buffer_time
from .cluster import ClusterSpec, ModelSpec
from .shape import AttnShape
from .strategies import Strategy, buffer_bytes, comm_bytes, memory_bytes

__all__ = ["ADAM_BYTES_PER_PARAM", "Prediction", "dense_token_seconds", "predict"]


@dataclass(frozen=True)
class Prediction:
    strategy: str
    team_size: int
    placement: str
    ulysses_size: int
    """U of the 2-D split (1: none)."""
    attn_fwd_s: float
    attn_bwd_s: float
    attn_s: float
    """Attention forward + backward of one layer, nothing overlapped with the projections."""
    layer_s: float
    """One transformer layer forward + backward (the forward twice with activation
    recompute); the attention's communication is not overlapped with the projections."""
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


def dense_token_seconds(cluster: ClusterSpec, model: ModelSpec, recompute: bool = False) -> float:
    """Seconds one token costs a layer besides its attention call: the QKV, output and MLP
    GEMMs forward and backward (twice the forward), the forward once more under activation
    recompute, at the cluster's ``matmul_flops`` (``predict``'s layer without attention)."""
    qkv, rest = _dense_flops(model, 1)
    return ((2 if recompute else 1) + 2) * (qkv + rest) / cluster.matmul_flops


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
    optim = buffer_time(cl, model.params / p * ADAM_BYTES_PER_PARAM)
    return sync, head + optim


def predict(
    strategy: Strategy,
    cluster: ClusterSpec,
    shape: AttnShape,
    model: ModelSpec | None = None,
    *,
    recompute: bool = True,
    features=None,
) -> Prediction:
    """Predicted time, bytes and memory per rank of one strategy on one cluster.

    Without ``model`` the layer is attention only (no projections, no MLP, no
    iteration terms) and memory counts the attention's working set alone.
    ``recompute``: full activation checkpointing, as ``memory_bytes`` assumes (the
    paper's eqs. 8-10): the backward first reruns the layer's forward, attention and
    its communication included. ``features`` (``memory.StepFeatures``): memory is the
    whole training step's under those options (recompute, tilings, the fused loss; the
    logits included) instead of the paper's full-checkpointing model.
    """
    if shape.cp_size > cluster.num_gpus:
        raise ValueError(
            f"cp_size={shape.cp_size} exceeds the cluster's {cluster.num_gpus} GPUs "
            f"({cluster.num_nodes} nodes x {cluster.gpus_per_node})"
        )
    spec = strategy.spec
    heads = dict(cp_size=shape.cp_size, heads_q=shape.heads_q, heads_kv=shape.heads_kv)
    if not spec.supported(*heads.values()):
        raise ValueError(spec.requirement.format(**heads))
    fwd, bwd = spec.times(strategy, cluster, shape)
    buf_f, buf_b = buffer_bytes(
        strategy, shape, rs_via_allreduce=cluster.reduce_scatter_via_allreduce
    )
    fwd += buffer_time(cluster, buf_f)
    bwd += buffer_time(cluster, buf_b)
    attn = fwd + bwd
    layer, mem, step, sync = attn, None, attn, 0.0
    if model is not None:
        qkv_f, rest_f = _dense_flops(model, shape.s_local * shape.batch)
        t_qkvp, t_rest = qkv_f / cluster.matmul_flops, rest_f / cluster.matmul_flops
        layer_fwd = fwd + t_qkvp + t_rest
        passes = 2 if recompute else 1
        layer = passes * layer_fwd + bwd + 2 * (t_qkvp + t_rest)  # dense backward = 2x forward
        mem = memory_bytes(strategy, shape, model, features=features)["total"]
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
        placement=strategy.placement_label,
        ulysses_size=strategy.ulysses_size,
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
