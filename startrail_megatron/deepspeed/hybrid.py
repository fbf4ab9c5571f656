"""``startrail.hybrid_context_parallel``: per-batch CP layouts for transformers models.

Megatron's hybrid context parallelism on the DeepSpeed path, over the P ranks of a
replica (``schedule/batch.py``'s Note [per-batch CP layouts]). Each batch is one row of
packed documents (position ids restarting at 0 per document, as
``DataCollatorWithFlattening`` makes; a row whose ids step by one is one document). Per
batch, every rank of the replica, from the same row:

1. schedules it: ``planner.batch.schedule_batch`` places each document on an aligned
   sub-group (block) of the P ranks of its own size, one rank alone where it is short,
   with the largest team size up to ``startrail.team_size`` that fits the block, priced on
   ``startrail.batch_cluster`` for the model's layer (its attention and GEMMs, read from
   the transformers config) and within ``startrail.max_tokens_per_rank`` where given. The
   layout is a pure function of the row's lengths and the config: the same on every rank
   (``batch_attention`` checks its fingerprint before the first transfer);
2. keeps its own rows (``batch_attention.shard_batch``): its block's documents packed and
   zigzag-sharded over the block, labels shifted over each document first (``-100`` at a
   document's last token and on the padding), position ids per document (RoPE);
3. runs the model once: every attention layer calls ``batch_attention`` (StarTrail over the
   rank's block with the block's team size and ``cu_seqlens``).

A rank whose block holds no document (fewer or shorter documents than ranks) runs one
padding token instead (id 0, position 0, label ``-100``) so that it joins DeepSpeed's
gradient reduction with every parameter in its graph: its attention output is that
token's value (its only key), zero-weighted on the query and key so that their gradients
are zeros rather than missing; the label ``-100`` keeps the token out of the loss and of
every gradient. The loss: each rank's token-loss sum over the replica's valid tokens, as
the static path (``batches.loss_normalizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..batch_attention import shard_batch
from ..schedule.batch import BatchLayout
from ..schedule.layout import divisors, team_size_within
from .batches import IGNORE_INDEX, packed_row_layout
from .config import StarTrailConfig, batch_cluster

__all__ = ["HybridSchedule", "idle_attention"]


def _layer_model(model):
    """The planner's ``ModelSpec`` of a transformers model's decoder layer, or ``None``
    where its config does not describe one (the layout then balances attention alone)."""
    from ..planner.cluster import ModelSpec

    cfg = model.config
    try:
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        return ModelSpec(
            "transformers", int(cfg.num_hidden_layers), hidden, heads,
            int(getattr(cfg, "num_key_value_heads", None) or heads),
            int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
            gated_mlp=any(hasattr(m, "gate_proj") for m in model.modules()),
            vocab=int(getattr(cfg, "vocab_size", None) or 1),
        )  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class HybridSchedule:
    """What places a batch's documents on the P ranks of a replica (module docstring).

    Attributes:
        cp_size: P.
        team_sizes: ``{block size: team size}``, the largest up to ``startrail.team_size``.
        priced: ``schedule_batch``'s keywords for the model (heads, head size, element
            bytes, the cluster, the layer).
        max_tokens_per_rank: ``startrail.max_tokens_per_rank``.
        layouts: the layouts scheduled on this rank, newest last (the last 64; the tests
            and a user's logging read them).
    """

    cp_size: int
    team_sizes: dict
    priced: dict = field(repr=False)
    max_tokens_per_rank: int | None = None
    layouts: list = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def for_hf_model(
        cls, model, config: StarTrailConfig, elem_bytes: int | None = None
    ) -> HybridSchedule:
        """The schedule of ``config`` for a transformers model (its attention heads, head
        size and layer, recomputed where its activation checkpointing is on at this call;
        ``elem_bytes``: the training dtype's, default the parameters')."""
        p, cfg = config.sequence_parallel_size, model.config
        heads = int(cfg.num_attention_heads)
        cluster = batch_cluster(config.batch_cluster, p)
        priced = dict(
            heads_q=heads,
            heads_kv=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            elem_bytes=elem_bytes or next(model.parameters()).element_size(),
            cluster=cluster,
            model=_layer_model(model),
            # transformers' activation checkpointing runs each layer's forward twice
            recompute=bool(getattr(model, "is_gradient_checkpointing", False)),
        )
        sizes = {k: team_size_within(k, config.team_size) for k in divisors(p)}
        return cls(p, sizes, priced, config.max_tokens_per_rank)

    def layout(self, lengths: list[int]) -> BatchLayout:
        """The layout of documents of ``lengths`` (``ValueError`` naming
        ``startrail.max_tokens_per_rank`` where no layout keeps within it)."""
        from ..planner.batch import schedule_batch

        cap = self.max_tokens_per_rank
        try:
            layout = schedule_batch(
                lengths, self.cp_size, **self.priced, team_sizes=self.team_sizes,
                max_tokens_per_rank=cap,
            )  # fmt: skip
        except ValueError as e:
            if cap is None or "max_tokens_per_rank" not in str(e):
                raise
            raise ValueError(f"startrail.max_tokens_per_rank={cap}: {e}") from None
        if len(self.layouts) >= 64:
            del self.layouts[0]
        self.layouts.append(layout)
        return layout

    def shard(
        self, input_ids: Tensor, labels: Tensor | None, position_ids: Tensor | None, cp_rank: int
    ) -> tuple[dict[str, Tensor], BatchLayout]:
        """(this rank's rows, the batch's layout) of one row ``[1, S]``: ``input_ids``,
        ``position_ids`` and, with labels, ``shift_labels`` (each ``[1, local]``)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                "startrail.hybrid_context_parallel takes one row of packed documents per batch "
                "(position_ids restarting at 0 per document, DataCollatorWithFlattening's "
                f"layout); got input_ids of shape {tuple(input_ids.shape)}"
            )
        s = input_ids.shape[1]
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must be shaped like input_ids {(1, s)}")
        packed = packed_row_layout(position_ids, (1, s), 1)
        lengths = list(packed.lengths) if packed is not None else [s]
        layout = self.layout(lengths)
        if position_ids is None:
            pos = torch.arange(s, device=input_ids.device)
        else:  # RoPE's positions: per document, or the one document's as given
            pos = position_ids.expand(1, s)[0]
        rows = {"input_ids": (input_ids[0], 0), "position_ids": (pos, 0)}
        if labels is not None:
            shifted = torch.nn.functional.pad(labels[0, 1:], (0, 1), value=IGNORE_INDEX)
            end = 0
            for n in lengths:  # a document's last token predicts nothing across the boundary
                end += n
                shifted[end - 1] = IGNORE_INDEX
            rows["shift_labels"] = (shifted, IGNORE_INDEX)
        idle = layout.idle(layout.block_of(cp_rank))
        out = {}
        for key, (x, fill) in rows.items():
            local = shard_batch(x, layout, cp_rank, fill=fill)
            if idle:  # one padding token (module docstring)
                local = x.new_full((1,), IGNORE_INDEX if key == "shift_labels" else 0)
            out[key] = local[None]
        return out, layout


def idle_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """The attention of an idle rank's one padding token (module docstring): ``query``
    ``[b, hq, 1, d]``, ``key``/``value`` ``[b, hkv, 1, d]`` -> ``[b, 1, hq, d]``, its
    value, with the query and key in the graph at weight zero."""
    if query.shape[2] != 1:
        raise ValueError(
            f"a rank whose block holds no document runs one padding token; got {query.shape[2]}"
        )
    rep = query.shape[1] // value.shape[1]
    out = value.repeat_interleave(rep, dim=1)
    out = out + 0.0 * (query.sum() + key.sum())
    return out.transpose(1, 2)
