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
    "split_a2a_work",
    "startrail_attention_work",
    "startrail_buffers",
    "ulysses_attention_work",
]


def _elems(shape: AttnShape) -> tuple[int, int, int]:
    """(local token rows, elements of one local q (or out), of one local k (or v))."""
    tok = shape.s_local * shape.batch
    return tok, tok * shape.heads_q * shape.head_dim, tok * shape.heads_kv * shape.head_dim


def startrail_buffers(team_size: int, shape: AttnShape) -> dict[str, int]:
    """Bytes of each buffer StarTrail (ring: C = 1) holds at its peak, a kernel call of a
    backward sub-ring step, named after ``rank.backward.startrail_rank_backward``'s
    tensors (``do_team``: its ``dout_team``; ``kv_cur``: the K,V ``KVRing.held`` gives;
    ``next KV in flight``: the ring's receive buffer).

    The caller's q, k, v, out and dout are not counted (with C = 1, ``q_team`` and
    ``do_team`` are q and dout themselves). What the forward keeps (``(saved)``): the
    team's q and this rank's own K,V, with the output (C + 3) A; the paper keeps the
    team's K,V, (3C + 1) A, but the placement here sends each member's K,V straight
    from the member (``schedule/layout.py``'s Note). The rest is the backward's working set:
    what double-buffering both directions of the sub-ring needs (``G > 1``) and fp32
    where sums accumulate over calls and steps: a step's dK/dV is added straight into the
    partial sum received for it (``rank.dkv.StepDkvSum``). ``kernel call`` is the largest
    call's gradients (at most the whole team block); the kernel's own workspace comes on top (``tests/test_memory.py``
    measures it).
    """
    c, g = team_size, shape.cp_size // team_size**2
    e, a = shape.elem_bytes, shape.acc_bytes
    tok, uq, ukv = _elems(shape)
    team_q, team_kv, rows = c * uq, c * 2 * ukv, c * tok * shape.heads_q
    steps = g > 1
    return {
        "q_team (saved)": team_q * e if c > 1 else 0,
        "kv_local (saved)": 2 * ukv * e,
        "lse_team (saved)": rows * a,
        "do_team": team_q * e if c > 1 else 0,
        "delta, delta_team": (tok * shape.heads_q + rows) * a,
        "out_eff": team_q * e,
        "dq": team_q * a,
        "kv_cur": team_kv * e,
        "next KV in flight": team_kv * e if steps else 0,
        "dkv": team_kv * a,  # from the second step on, the partial sum received into
        "dkv sent, in flight": team_kv * a if steps else 0,
        "kernel call": (team_q + team_kv) * e,
    }


def startrail_attention_work(team_size: int, shape: AttnShape) -> int:
    """StarTrail's (and ring's) working set at its peak (the backward), bytes: the sum of
    ``startrail_buffers``."""
    return sum(startrail_buffers(team_size, shape).values())


def split_a2a_work(ring: AttnShape) -> int:
    """The 2-D split's all-to-all buffers on top of StarTrail's over its ring group: the
    send and receive buffers of q, k, v (``rank/ulysses.py``; freed before the backward's,
    which are the same sizes). ``ring``: the shape after the all-to-all."""
    _, uq, ukv = _elems(ring)
    return 2 * (uq + 2 * ukv) * ring.elem_bytes


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
