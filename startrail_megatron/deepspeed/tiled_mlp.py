"""Tiled MLPs for transformers models: DeepSpeed's own ``TiledMLP`` around each decoder
layer's MLP (``"startrail": {"tiled_mlp": TOKENS}``).

DeepSpeed's ``TiledMLP`` (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, ALST, arXiv
2506.13996) runs a module's forward on sequence shards without a graph and recomputes each
shard with gradients in the backward, so an MLP's ``[tokens, intermediate]`` tensors exist
for one shard at a time; under ZeRO-3 it holds the parameters' gradients back until the last
shard (``ds_grad_is_ready``). It fits transformers' dense MLPs as they are (a module called
on ``[b, s, h]``), so this is a thin wrapper: the shard count is this rank's local sequence
over TOKENS, rounded up (every rank of a sequence group holds as many tokens, so they agree).
Mixture-of-experts blocks are refused by name (their router and experts are not one
position-wise function DeepSpeed's shards may cut: the router's load-balancing statistics
would be per shard).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

from torch import nn

__all__ = ["TiledMLPStats", "tile_hf_mlps"]


@dataclass
class TiledMLPStats:
    """What the tiling did on this rank (a test's proof): tile, MLPs tiled, calls, shards."""

    tokens: int
    layers: int = 0
    calls: int = 0
    shards: int = 0
    max_shard_rows: int = 0
    _undo: list = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Give every MLP its own forward back."""
        for mlp in self._undo:
            if "forward" in mlp.__dict__:
                del mlp.forward
        self._undo = []


def _is_moe(mlp: nn.Module) -> bool:
    name = type(mlp).__name__.lower()
    return hasattr(mlp, "experts") or hasattr(mlp, "router") or "moe" in name or "sparse" in name


def _mlp_dropout(mlp: nn.Module) -> str | None:
    """What in ``mlp`` draws dropout (a ``Dropout`` with p > 0, or a positive ``*dropout*``
    attribute its forward reads, e.g. Starcoder2's ``residual_dropout``), or None."""
    for name, m in mlp.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"{name or 'the MLP'} (p={m.p})"
    for m in mlp.modules():
        for key, value in vars(m).items():
            if "dropout" in key and isinstance(value, float) and value > 0:
                return f"{key}={value}"
    return None


def tile_hf_mlps(model: nn.Module, tokens: int) -> TiledMLPStats:
    """Wrap the MLP of every decoder layer of ``model`` (a module with ``mlp`` beside
    ``self_attn``) in DeepSpeed's ``TiledMLP`` at ``tokens`` sequence positions per shard.
    ``ValueError`` naming ``startrail.tiled_mlp`` for a bad tile, a model without such
    layers, or a mixture-of-experts MLP."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"startrail.tiled_mlp={tokens!r}: give a whole number of tokens >= 1")
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    layers = [m for m in model.modules() if hasattr(m, "mlp") and hasattr(m, "self_attn")]
    if not layers:
        raise ValueError(
            f"startrail.tiled_mlp: {type(model).__name__} has no decoder layers with an "
            "'mlp' beside 'self_attn'"
        )
    for layer in layers:
        if _is_moe(layer.mlp):
            raise ValueError(
                f"startrail.tiled_mlp: {type(layer.mlp).__name__} is a mixture-of-experts "
                "block; only dense MLPs are tiled (drop startrail.tiled_mlp for this model)"
            )
        drop = _mlp_dropout(layer.mlp)
        if drop is not None:  # TiledMLP recomputes without restoring the RNG: other masks
            raise ValueError(
                f"startrail.tiled_mlp: {type(layer.mlp).__name__} applies dropout ({drop}), "
                "which DeepSpeed's TiledMLP would draw again, differently, in its backward "
                "recompute (wrong gradients); set that dropout to 0 or drop startrail.tiled_mlp"
            )
    stats = TiledMLPStats(tokens=tokens)

    def run(self, x):  # TiledMLP's fn(self, x): the module's own forward
        return type(self).forward(self, x)

    def forward(self, x):
        seq = x.shape[-2]
        shards = max(1, math.ceil(seq / tokens))
        stats.calls += 1
        stats.shards += shards
        stats.max_shard_rows = max(stats.max_shard_rows, math.ceil(seq / shards))
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(run, self, x, shards, params)

    for layer in layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)
        stats._undo.append(layer.mlp)
    stats.layers = len(layers)
    return stats
