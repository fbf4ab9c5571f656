"""One autograd node for a computation cut into sequence tiles and recomputed in the
backward: what the tiled loss (``tiled_loss.py``) and the tiled MLPs (``tiled_mlp.py``) run.

``sequence_tiled(run, stats, hidden, *params)``: the forward calls ``run(tile, start)`` on
each tile of ``hidden``'s first (sequence) dimension without keeping anything but its input,
and concatenates the results; the backward calls ``run`` again on each tile with gradients
and takes that tile's gradients at once, so only one tile's intermediates are ever alive,
and sums the gradients of ``params`` (the leaves ``run`` uses) over the tiles in fp32
(float64 ones in float64: ``kernels.contract.acc_dtype``). A parameter as large as the
output layer's (vocabulary x hidden) is held twice at most: the sum (the first tile's
gradient itself) and one tile's gradient; once, where it is shared with a later node and
has Megatron DDP's fp32 ``main_grad`` (``sequence_tiled(shared=)``): each tile's gradient
is added there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.contract import acc_dtype
from ..validation import first_order_only

__all__ = ["TileStats", "sequence_tiled"]


@dataclass
class TileStats:
    """What a tiling did on this rank (a test's proof): its tile, the layers it tiles (the
    MLPs; 0 for the loss), calls, tiles, the most rows a tile had, and how many parameters
    the last backward added straight into their DDP buffer (``sequence_tiled(shared=)``)."""

    tokens: int = 0
    layers: int = 0
    calls: int = 0
    tiles: int = 0
    max_tile_rows: int = 0
    into_main_grad: int = 0  # parameters whose tiles' gradients went into ``main_grad``

    def tiled(self, rows: int) -> range:
        """The starts of ``rows`` cut into tiles of ``tokens``, counted as one call."""
        self.calls += 1
        self.tiles += -(-rows // self.tokens)
        self.max_tile_rows = max(self.max_tile_rows, min(self.tokens, rows))
        return range(0, rows, self.tokens)


def _main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s Megatron DDP gradient buffer, where a tile's gradient may be added straight
    in: fp32, the parameter's shape (not Megatron-FSDP's, made on demand)."""
    main = getattr(param, "main_grad", None)
    if main is None or hasattr(param, "__fsdp_param__"):
        return None
    if main.dtype != torch.float32 or main.shape != param.shape:
        return None
    return main


class _SequenceTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, stats, direct, hidden, *params):
        tile = stats.tokens
        with torch.no_grad():
            outs = [run(hidden[i : i + tile], i) for i in stats.tiled(hidden.shape[0])]
        ctx.run, ctx.tile, ctx.stats, ctx.direct = run, tile, stats, direct
        ctx.save_for_backward(hidden, *params)
        return torch.cat(outs)

    @staticmethod
    @first_order_only(
        "the sequence-tiled MLP or loss (--startrail-tiled-mlp, --startrail-tiled-loss)"
    )
    def backward(ctx, grad):
        hidden, *params = ctx.saved_tensors
        tile = ctx.tile
        d_hidden = torch.empty_like(hidden)
        d_params: list[torch.Tensor | None] = [None] * len(params)
        # A parameter another node also uses (the tied embedding) takes its tiles' gradients
        # straight into its DDP buffer: autograd would hold this node's whole sum until the
        # other use's gradient arrives (the embedding's, after every layer's backward).
        mains = [_main_grad(p) if d else None for p, d in zip(params, ctx.direct)]
        ctx.stats.into_main_grad = sum(m is not None for m in mains)
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
                if mains[k] is not None:
                    mains[k].add_(g)
                elif d_params[k] is not None:
                    d_params[k] += g
                elif g.dtype == acc_dtype(g.dtype) and g.untyped_storage().data_ptr() not in taken:
                    d_params[k] = g  # the first tile's own gradient becomes the sum
                else:
                    d_params[k] = g.to(acc_dtype(g.dtype), copy=True)
            del grads, g  # the next tile's gradients must not meet these (a parameter each)
        d_params = [
            None if m is not None else torch.zeros_like(p) if d is None else d.to(p.dtype)
            for d, p, m in zip(d_params, params, mains)
        ]
        return (None, None, None, d_hidden, *d_params)


def sequence_tiled(run, stats: TileStats, hidden, *params, shared=()):
    """``run`` over ``hidden`` in tiles of ``stats.tokens`` rows, recomputed in the backward
    (module docstring); ``params``: the leaves requiring gradients that ``run`` uses.

    ``shared``: one flag per parameter, True where another node of the same backward also
    takes the parameter's gradient after this one (the output weight tied to the word
    embedding, whose lookup runs in the same model): where it has Megatron DDP's fp32
    ``main_grad``, each tile's gradient is added there at once and this node returns none
    for it, so its sum is not held until the embedding's gradient arrives; DDP adds the
    embedding's own gradient (``param.grad``) to the same buffer in its hook, as always.
    Not for a parameter no other node uses: its gradient hook would never fire."""
    direct = tuple(shared) or (False,) * len(params)
    if len(direct) != len(params):
        raise ValueError(f"sequence_tiled: {len(direct)} shared flags for {len(params)} params")
    return _SequenceTiled.apply(run, stats, direct, hidden, *params)
