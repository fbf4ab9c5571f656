"""One autograd node for a computation cut into sequence tiles and recomputed in the
backward: what the tiled loss (``tiled_loss.py``) and the tiled MLPs (``tiled_mlp.py``) run.

``sequence_tiled(run, stats, hidden, *params)``: the forward calls ``run(tile, start)`` on
each tile of ``hidden``'s first (sequence) dimension without keeping anything but its input,
and concatenates the results; the backward calls ``run`` again on each tile with gradients
and takes that tile's gradients at once, so only one tile's intermediates are ever alive,
and sums the gradients of ``params`` (the leaves ``run`` uses) over the tiles in fp32
(float64 ones in float64: ``kernels.contract.acc_dtype``). A parameter as large as the
output layer's (vocabulary x hidden) is held twice at most: the sum (the first tile's
gradient itself) and one tile's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.contract import acc_dtype

__all__ = ["TileStats", "sequence_tiled"]


@dataclass
class TileStats:
    """What a tiling did on this rank (a test's proof): its tile, the layers it tiles (the
    MLPs; 0 for the loss), calls, tiles, the most rows a tile had."""

    tokens: int = 0
    layers: int = 0
    calls: int = 0
    tiles: int = 0
    max_tile_rows: int = 0

    def tiled(self, rows: int) -> range:
        """The starts of ``rows`` cut into tiles of ``tokens``, counted as one call."""
        self.calls += 1
        self.tiles += -(-rows // self.tokens)
        self.max_tile_rows = max(self.max_tile_rows, min(self.tokens, rows))
        return range(0, rows, self.tokens)


class _SequenceTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, stats, hidden, *params):
        tile = stats.tokens
        with torch.no_grad():
            outs = [run(hidden[i : i + tile], i) for i in stats.tiled(hidden.shape[0])]
        ctx.run, ctx.tile = run, tile
        ctx.save_for_backward(hidden, *params)
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        hidden, *params = ctx.saved_tensors
        tile = ctx.tile
        d_hidden = torch.empty_like(hidden)
        d_params: list[torch.Tensor | None] = [None] * len(params)
        taken = {t.untyped_storage().data_ptr() for t in (grad, hidden, *params)}
        for i in range(0, hidden.shape[0], tile):
            with torch.enable_grad():
                h = hidden[i : i + tile].detach().requires_grad_()
                grads = torch.autograd.grad(
                    ctx.run(h, i), (h, *params), grad[i : i + tile], allow_unused=True
                )
            d_hidden[i : i + tile] = grads[0]
            for k, g in enumerate(grads[1:]):
                if g is None:
                    continue
                if d_params[k] is not None:
                    d_params[k] += g
                elif g.dtype == acc_dtype(g.dtype) and g.untyped_storage().data_ptr() not in taken:
                    d_params[k] = g  # the first tile's own gradient becomes the sum
                else:
                    d_params[k] = g.to(acc_dtype(g.dtype), copy=True)
            del grads, g  # the next tile's gradients must not meet these (a parameter each)
        d_params = [torch.zeros_like(p) if d is None else d for d, p in zip(d_params, params)]
        return (None, None, d_hidden, *(d.to(p.dtype) for d, p in zip(d_params, params)))


def sequence_tiled(run, stats: TileStats, hidden, *params):
    """``run`` over ``hidden`` in tiles of ``stats.tokens`` rows, recomputed in the backward
    (module docstring); ``params``: the leaves requiring gradients that ``run`` uses."""
    return _SequenceTiled.apply(run, stats, hidden, *params)
