"""Rank every candidate strategy for one cluster, model, sequence length and CP size."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import ClusterSpec, ModelSpec
from .placement import map_strategies
from .prediction import Prediction, predict
from .shape import AttnShape
from .strategies import candidate_strategies

__all__ = ["Plan", "plan"]


@dataclass(frozen=True)
class Plan:
    cluster: ClusterSpec
    model: ModelSpec
    seq_len: int
    cp_size: int
    batch: int
    rows: list[Prediction]
    """Every candidate, in candidate order (StarTrail by C and placement, then peers)."""
    recommended: Prediction | None
    """The fastest StarTrail (C, placement) that fits in memory (None if none fits)."""
    fastest: Prediction | None
    """The fastest fitting strategy of all, peers included."""
    features: object = None
    """The whole-step memory options (``memory.StepFeatures``), or None (the paper's model)."""
    maps: dict = field(default_factory=dict)
    """Strategy name -> the placement map of each computed-map row
    (``placement.map_strategies``), logical rank -> CP rank (the split's: ring rank)."""

    def as_dict(self) -> dict:
        return {
            "cluster": self.cluster.__dict__,
            "model": self.model.__dict__,
            "seq_len": self.seq_len,
            "cp_size": self.cp_size,
            "batch": self.batch,
            "rows": [r.as_dict() for r in self.rows],
            "recommended": self.recommended.as_dict() if self.recommended else None,
            "fastest": self.fastest.as_dict() if self.fastest else None,
            "features": None if self.features is None else self.features.__dict__,
            "maps": {k: list(v) for k, v in self.maps.items()},
        }


def plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    seq_len: int,
    cp_size: int,
    *,
    batch: int = 1,
    elem_bytes: int = 2,
    recompute: bool = True,
    window: int | None = None,
    features=None,
    map_search: bool = True,
) -> Plan:
    """Predict every valid (C, placement) and the peers; recommend the fastest that fits.

    ``recompute``: full activation checkpointing (the layer's forward rerun in the backward).
    ``features`` (``memory.StepFeatures``): the memory column is the whole step's under
    those options (``predict``).
    ``window``: a causal sliding window of that many tokens on every layer
    (``startrail_attention(window=(window - 1, 0))``): StarTrail is charged the pairs in the
    window and the sub-ring steps it runs (``AttnShape.window``); the all-gather and Ulysses
    peers the window's pairs in their calls.
    ``map_search``: also StarTrail and the split under the placement map computed for the
    cluster's nodes (``placement.map_strategies``), where it beats both named placements.
    Raises ``ValueError`` for a CP size larger than the cluster or a sequence
    that does not split into 2*cp_size zigzag chunks.
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be an integer >= 1")
    if cp_size > cluster.num_gpus:
        raise ValueError(
            f"cp_size={cp_size} exceeds the cluster's {cluster.num_gpus} GPUs "
            f"({cluster.num_nodes} nodes x {cluster.gpus_per_node})"
        )
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window={window!r} must be a number of tokens >= 1 (or None)")
    if window is not None and not model.causal:
        raise ValueError(
            f"window={window} is a causal sliding window; model {model.name!r} is not causal"
        )
    win = None if window is None else (window - 1, 0)
    shape = AttnShape.for_model(model, seq_len, cp_size, batch, elem_bytes=elem_bytes, window=win)
    candidates = candidate_strategies(cp_size, model.heads, model.kv_heads)
    mapped = map_strategies(cluster, shape, candidates) if map_search else []
    rows = [
        predict(s, cluster, shape, model, recompute=recompute, features=features)
        for s in candidates + mapped
    ]
    fitting = [r for r in rows if r.fits]
    star = [r for r in fitting if r.strategy.startswith(("startrail", "ring"))]
    return Plan(
        cluster,
        model,
        seq_len,
        cp_size,
        batch,
        rows,
        min(star, key=lambda r: r.layer_s) if star else None,
        min(fitting, key=lambda r: r.layer_s) if fitting else None,
        features,
        {s.name: s.placement for s in mapped},
    )
