"""Peak memory per rank: model states, checkpoints and the layer's working set.

``memory_breakdown`` adds a strategy's attention working set (the functions
here, picked by ``strategies.memory_bytes``) to what every strategy holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import ModelSpec
from .shape import AttnShape

__all__ = [
    "StepFeatures",
    "allgather_attention_work",
    "memory_breakdown",
    "split_a2a_work",
    "startrail_attention_work",
    "step_bytes_per_token",
    "startrail_buffers",
    "ulysses_attention_work",
]


def _elems(shape: AttnShape) -> tuple[int, int, int]:
    """(local token rows, elements of one local q (or out), of one local k (or v))."""
    tok = shape.s_local * shape.batch
    return tok, tok * shape.heads_q * shape.head_dim, tok * shape.heads_kv * shape.head_dim


def startrail_buffers(
    team_size: int, shape: AttnShape, tile: int | None = None, head_chunks: int = 1
) -> dict[str, int]:
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
    call's output stand-in (made from the rows' D, ``rank.kernel_calls.delta_stand_in``)
    and gradients: at most the whole team block, at most ``tile`` x ``tile`` tokens with
    ``startrail_attention(tile=)``; the kernel's own workspace comes on top
    (``tests/test_memory.py`` measures it). ``head_chunks`` (``startrail_attention(
    head_chunks=)``): the backward runs one KV-head group at a time, so its working set and
    a call are 1/``head_chunks`` as large; what the forward kept (every group's) is not.
    """
    c, g = team_size, shape.cp_size // team_size**2
    e, a = shape.elem_bytes, shape.acc_bytes
    tok, uq, ukv = _elems(shape)
    team_q, team_kv, rows = c * uq, c * 2 * ukv, c * tok * shape.heads_q
    steps = g > 1
    n = head_chunks
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or shape.heads_kv % n:
        raise ValueError(f"head_chunks={n!r} must be an integer >= 1 dividing the KV heads")
    call_rows = shape.batch * (c * shape.s_local if tile is None else min(tile, c * shape.s_local))
    call_q = call_rows * shape.heads_q * shape.head_dim
    call_kv = call_rows * 2 * shape.heads_kv * shape.head_dim
    return {
        "q_team (saved)": team_q * e if c > 1 else 0,
        "kv_local (saved)": 2 * ukv * e,
        "lse_team (saved)": rows * a,
        "do_team": team_q * e // n if c > 1 else 0,
        "delta, delta_team": (tok * shape.heads_q + rows) * a // n,
        "dq": team_q * a // n,
        "kv_cur": team_kv * e // n,
        "next KV in flight": team_kv * e // n if steps else 0,
        "dkv": team_kv * a // n,  # from the second step on, the partial sum received into
        "dkv sent, in flight": team_kv * a // n if steps else 0,
        "kernel call": (2 * call_q + call_kv) * e // n,
        # a chunk's heads of the caller's dout, made contiguous for its gather
        "dout chunk": uq * e // n if n > 1 else 0,
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
    work: int,
    shape: AttnShape,
    model: ModelSpec,
    zero_shards: int | None = None,
    features: StepFeatures | None = None,
    buffers: dict[str, int] | None = None,
    team_size: int = 1,
) -> dict[str, float]:
    """Peak memory per rank, refined from real tensor sizes (GQA included), for a strategy
    whose attention working set is ``work`` bytes.

    ``model_states``: bf16 weights (replicated), bf16 gradients and fp32
    master weights and Adam moments (12 bytes/param) sharded over
    ``zero_shards`` ranks (ZeRO-2 over the CP group by default, as in the paper). ``checkpoints``: one layer input
    ``[s, b, H]`` per layer (full activation checkpointing). ``layer``: the
    layer recomputed in the backward, its MLP intermediates, and the
    attention's working set at its peak (the backward) for this strategy.

    With ``features`` (``StepFeatures``): the whole step instead, ``activations`` the
    larger phase of ``step_bytes_per_token`` (the logits and loss included) times the
    local tokens, plus the tiles' own fixed costs (a tile's fp32 logits and their
    gradient; a tile's MLP intermediates, forward and recomputed); ``buffers``: the
    attention's named buffers (``startrail_buffers``; a peer's one working set otherwise).
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
    if features is not None:
        per = step_bytes_per_token(
            shape, model, team_size, buffers if buffers is not None else {"work": work}, features
        )
        tiles = 0.0
        if features.tiled_loss:
            tiles += 2 * min(features.tiled_loss, tok) * model.vocab * 4
        if features.tiled_mlp:
            fc1 = (2 if model.gated_mlp else 1) * model.ffn_hidden
            tiles += 3 * min(features.tiled_mlp, tok) * fc1 * e
        acts = per["step"] * tok + tiles
        return {
            "model_states": states,
            "activations": acts,
            "bytes_per_token": per["step"],
            "attention_work": work,
            "total": states + acts,
        }
    total = states + checkpoints + dense + local + work
    return {
        "model_states": states,
        "checkpoints": checkpoints,
        "layer": dense + local + work,
        "attention_work": work,
        "total": total,
    }


RECOMPUTE = ("full", "selective", "none")

FUSED_CE_EXTRA = 1.5
"""[tokens, vocab] fp32 copies megatron-core's fused cross-entropy holds at the step's peak
beyond the unfused one's single in-place copy. Measured, not derived (docs/performance.md
section 14): its ``jit_fuser`` (``torch.compile``) functions work out of place, so the
max-subtracted logits and their exponentials are new tensors, one of them transient."""


@dataclass(frozen=True)
class StepFeatures:
    """What a training step keeps per token (the Megatron adapter's options):
    ``recompute`` (``full``: every layer's input only, the layer recomputed in the
    backward; ``selective``: the core attention recomputed; ``none``), ``tiled_loss`` /
    ``tiled_mlp`` (tokens per tile, or None: ``--startrail-tiled-loss`` /
    ``--startrail-tiled-mlp``), ``attention_tile`` (the attention's largest kernel call,
    ``--startrail-attention-tile``: ``startrail_buffers(tile=)``), ``attention_head_chunks``
    (``--startrail-attention-head-chunks``: ``startrail_buffers(head_chunks=)``), ``ce_fusion``
    (megatron-core's fused cross-entropy), ``dropout`` (hidden dropout's masks, one byte per element, twice per layer)."""

    recompute: str = "full"
    tiled_loss: int | None = None
    tiled_mlp: int | None = None
    attention_tile: int | None = None
    attention_head_chunks: int = 1
    ce_fusion: bool = False
    dropout: bool = True

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}; allowed: {list(RECOMPUTE)}")
        for f in ("tiled_loss", "tiled_mlp", "attention_tile"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{f}={v!r} must be None or an integer >= 1 (tokens per tile)")
        n = self.attention_head_chunks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"attention_head_chunks={n!r} must be an integer >= 1")
        if self.ce_fusion and self.tiled_loss is not None:
            raise ValueError("ce_fusion with tiled_loss: the tiled loss replaces the fused loss")


def step_bytes_per_token(
    shape: AttnShape, model: ModelSpec, team_size: int, work: dict[str, int], f: StepFeatures
) -> dict[str, float]:
    """Bytes per local token of a training step's two phases, and the step's (the larger).

    ``layers``: the transformer layers' backward, where the first layer to run its backward
    holds its working set on top of what every layer keeps; ``rest``: the logits and the
    loss, on top of what every layer keeps. ``work``: the attention's buffers at its peak
    (``startrail_buffers``' names; ``(saved)`` ones are counted here with the layer).

    Per layer, what megatron-core's layer saves for its backward (e = element bytes; C the
    team size, 1 for a peer): the two norms' inputs and outputs, q's part of the QKV output
    and the attention's output, and the residual, ``(5 + C) h`` with the team's q (``q``
    itself when C = 1); K and V out of the QKV projection and K after RoPE, ``3 kv``; the
    MLP's first projection, its activation and its product (``4 f`` gated, ``2 f`` not);
    the dropout masks (2 h bytes); the norms' statistics. Full recompute keeps a layer's
    input (h) only and rebuilds one layer's set in the backward, whose peak is the larger of
    its attention's backward (the part before the attention, the attention's buffers) and its
    MLP's (the whole set and the MLP's gradients, a tile's with the tiled MLP); selective
    keeps all but the team's q and K after RoPE. The tiled MLP keeps no MLP intermediate.
    The logits: fp32 [tokens, vocab] once (megatron-core's cross-entropy works in place; a
    bf16 model's logits are upcast, one more copy), ``1 + FUSED_CE_EXTRA`` times with the
    fused cross-entropy, never with the tiled loss (a tile's logits are a fixed cost).
    Checked against the whole-step benchmark (``startrail-bench --workload memory``;
    ``tests/test_planner.py``)."""
    e, h = shape.elem_bytes, model.hidden
    c = max(team_size, 1)
    tok = shape.s_local * shape.batch
    kv = shape.heads_kv * shape.head_dim
    mlp = 0 if f.tiled_mlp else (4 if model.gated_mlp else 2) * model.ffn_hidden
    layer_saved = e * ((5 + c) * h + 3 * kv + mlp) + (2 * h if f.dropout else 0) + 4 * 4
    kept = {
        "none": layer_saved,
        "selective": layer_saved - e * (c * h + kv),
        "full": e * h,
    }[f.recompute]
    before_attention = e * ((3 + c) * h + 3 * kv) + (h if f.dropout else 0)
    unsaved = sum(v for k, v in work.items() if "(saved)" not in k) / tok
    # + the residual's gradient in flight and the attention's output gradient (its caller's)
    d_attn = e * shape.heads_q * shape.head_dim
    layers = model.layers * kept + before_attention + unsaved + e * h + d_attn
    if f.recompute == "full":  # the recomputed layer's MLP backward: its whole set, and
        # the gradients of the MLP's first projection and of its activation
        mlp_grads = 0 if f.tiled_mlp else (3 if model.gated_mlp else 2) * model.ffn_hidden * e
        layers = max(layers, model.layers * kept + layer_saved + mlp_grads)
    vocab = model.vocab
    logits = 0.0 if f.tiled_loss else (4 * vocab + (e * vocab if e != 4 else 0))
    if f.ce_fusion:
        logits += FUSED_CE_EXTRA * 4 * vocab
    rest = model.layers * kept + 2 * e * h + logits
    return {"layers": layers, "rest": rest, "step": max(layers, rest)}
