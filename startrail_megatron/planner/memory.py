"""Peak memory per rank: model states, checkpoints and the layer's working set.

``memory_breakdown`` adds a strategy's attention working set (the functions
here, picked by ``strategies.memory_bytes``) to what every strategy holds.
"""

from __future__ import annotations

from .cluster import ModelSpec
from .shape import AttnShape

__all__ = [
    "allgather_attention_work",
    "memory_breakdown",
    "startrail_attention_work",
    "ulysses_attention_work",
]


def _elems(shape: AttnShape) -> tuple[int, int, int]:
    """(local token rows, elements of one local q (or out), of one local k (or v))."""
    tok = shape.s_local * shape.batch
    return tok, tok * shape.heads_q * shape.head_dim, tok * shape.heads_kv * shape.head_dim


def startrail_attention_work(team_size: int, shape: AttnShape) -> int:
    """StarTrail's (and ring's) working set at its peak (the backward), bytes."""
    e, a = shape.elem_bytes, shape.acc_bytes
    tok, uq, ukv = _elems(shape)
    n = team_size  # team tokens / local tokens
    return (
        n * (uq + 2 * ukv) * e  # team q, k, v (saved)
        + n * tok * shape.heads_q * a  # team lse
        + 2 * n * uq * e  # team dout and the out stand-in
        + 2 * n * 2 * ukv * e  # KV in use + KV in flight
        + n * uq * a  # dq accumulator
        + 2 * n * 2 * ukv * a  # dK/dV in use + in flight
        + n * (uq + 2 * ukv) * a  # the dq,dk,dv reduce-scatter buffer
    )


def allgather_attention_work(shape: AttnShape) -> int:
    """All-gather-KV: the gathered K,V (and its reorder), the dK/dV accumulator, lse, dq."""
    p, e, a = shape.cp_size, shape.elem_bytes, shape.acc_bytes
    tok, uq, ukv = _elems(shape)
    return p * 2 * ukv * e * 2 + p * 2 * ukv * a + tok * shape.heads_q * a + uq * a


def ulysses_attention_work(shape: AttnShape) -> int:
    """Ulysses: whole sequence, heads/P; the same element counts as local tensors."""
    e, a = shape.elem_bytes, shape.acc_bytes
    tok, uq, ukv = _elems(shape)
    return (2 * uq + 2 * ukv) * e * 2 + (uq + 2 * ukv) * a + tok * shape.heads_q * a


def memory_breakdown(
    work: int, shape: AttnShape, model: ModelSpec, zero_shards: int | None = None
) -> dict[str, float]:
    """Peak memory per rank, refined from real tensor sizes (GQA included), for a strategy
    whose attention working set is ``work`` bytes.

    ``model_states``: bf16 weights (replicated), bf16 gradients and fp32
    master weights and Adam moments (12 bytes/param) sharded over
    ``zero_shards`` ranks (ZeRO-2 over the CP group by default, as in the paper). ``checkpoints``: one layer input
    ``[s, b, H]`` per layer (full activation checkpointing). ``layer``: the
    layer recomputed in the backward, its MLP intermediates, and the
    attention's working set at its peak (the backward) for this strategy.
    """
    p = shape.cp_size
    zero = zero_shards or p
    e = shape.elem_bytes
    tok, uq, ukv = _elems(shape)
    h = model.hidden
    states = model.params * 2 + model.params * (2 + 12) / zero
    checkpoints = model.layers * tok * h * e
    dense = tok * (3 * h + 2 * model.ffn_hidden) * e  # ln/qkv/proj outputs, MLP intermediates
    local = (2 * uq + 2 * ukv) * e * 2  # q, k, v, out and their gradients
    total = states + checkpoints + dense + local + work
    return {
        "model_states": states,
        "checkpoints": checkpoints,
        "layer": dense + local + work,
        "attention_work": work,
        "total": total,
    }
