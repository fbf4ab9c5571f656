"""Peak memory per rank: model states, checkpoints and the layer's working set."""

from __future__ import annotations

from .cluster import ModelSpec
from .shape import AttnShape
from .strategies import Strategy

__all__ = ["memory_bytes"]


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
