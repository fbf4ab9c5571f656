"""Which documents each forward's attention calls run on (transformers models).

A forward of a prepared model holds one layout of its row's documents: a packed row's
``PackedLayout``, a per-batch ``BatchLayout`` (``startrail.hybrid_context_parallel``), or
None (one sequence per row). The attention function reads it at every call. Activation
checkpointing calls the attention again in the backward, after the forward has returned
and maybe after other forwards, so "the forward running now" is not enough:

1. ``of(position_ids)``: transformers hands every attention call the model's position ids
   tensor, and the recompute hands back the same tensor, so each forward's layout is
   kept against its position ids (a weak reference: entries of freed tensors go);
2. for models whose attention calls do not get the position ids, ``end`` registers a
   gradient hook on the forward's outputs that sets its layout back when the backward
   reaches them and clears it when that backward ends (right for one forward's backward
   at a time).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = ["ForwardDocuments"]


def _tensors(values):
    """The tensors among ``values``, inside tuples and lists too (``hidden_states``)."""
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _tensors(v)


class ForwardDocuments:
    """The documents' layout of the forward running now and of earlier forwards (module
    docstring)."""

    def __init__(self) -> None:
        self.now = None
        """The layout of the forward running now (None between forwards)."""
        self._by_positions: dict = {}

    def start(self, layout, position_ids: Tensor | None) -> None:
        """A forward begins with ``layout`` and the model input ``position_ids``."""
        self.now = layout
        for key in [k for k, (ref, _) in self._by_positions.items() if ref() is None]:
            del self._by_positions[key]
        if position_ids is not None and torch.is_grad_enabled():
            self._by_positions[id(position_ids)] = (weakref.ref(position_ids), layout)

    def of(self, position_ids: Tensor | None):
        """The layout of the forward whose model input ``position_ids`` is, else ``now``."""
        if position_ids is not None:
            seen = self._by_positions.get(id(position_ids))
            if seen is not None and seen[0]() is position_ids:
                return seen[1]
        return self.now

    def end(self, outputs) -> None:
        """The forward returned ``outputs`` (tensors, or tuples and lists of them): their
        gradient hooks set its layout back in the backward; ``now`` is cleared."""
        layout, self.now = self.now, None
        if not torch.is_grad_enabled():
            return

        def restore(grad):
            self.now = layout
            torch.autograd.Variable._execution_engine.queue_callback(self._clear)

        for v in _tensors(outputs):
            if v.requires_grad:
                v.register_hook(restore)

    def _clear(self) -> None:
        self.now = None
