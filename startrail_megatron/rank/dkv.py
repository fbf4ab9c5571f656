"""The backward's dK/dV sum of one sub-ring step, for the K,V held at it."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ..comm import Handle

__all__ = ["StepDkvSum"]

AddInto = Callable[[Tensor], None]
"""Adds a call's gradients into (the kv heads of) a step's dK/dV sum."""


class StepDkvSum:
    """One sub-ring step's dK/dV sum, fp32 ``[n, 2, b, hkv, d]``, for the K,V held at it.

    From the second computed step on it is the buffer that the previous holder's partial
    sum arrives in (``pending``, started after that step), waited on at the end of the
    step (``total``): the step's calls run while it travels. Their dK/dV gradients are
    kept (in the kernel's dtype) until it has arrived and are then added straight into
    it, so no second team-sized fp32 buffer is needed. A step of one call (every step
    after the first on dense rows) keeps just that call's gradients, alive anyway; the
    last step's head groups keep the first group's while the second computes, with no
    next K,V in flight then; under windows or packed documents a step of several calls
    keeps all of theirs. The first step adds into zeros at once."""

    def __init__(self, pending: Handle | None, like: Tensor, shape: tuple):
        self._pending, self._sum = pending, None
        self._kept: list[tuple[AddInto, slice]] = []
        if pending is None:
            self._sum = like.new_zeros(shape)

    def add(self, fn: AddInto, kv_heads: slice = slice(None)) -> None:
        """``fn(the sum's kv heads kv_heads)``: now, or once it has arrived (``total``)."""
        if self._sum is None:
            self._kept.append((fn, kv_heads))
        else:
            fn(self._sum[:, :, :, kv_heads])

    def total(self) -> Tensor:
        """The sum, with every kept gradient added (waits for it the first time)."""
        if self._sum is None:
            self._sum, self._pending = self._pending.wait(), None
            for fn, kv_heads in self._kept:
                fn(self._sum[:, :, :, kv_heads])
            self._kept.clear()
        return self._sum

    def row_adder(
        self, kv_heads: slice = slice(None), kv_rows: slice = slice(None)
    ) -> Callable[[Tensor, Tensor], None]:
        """``add`` for one row call: a function of its (g_k, g_v) on ``kv_heads``,
        ``kv_rows``."""

        def add_call(g_k: Tensor, g_v: Tensor) -> None:
            def fn(t: Tensor) -> None:
                t[kv_rows, 0] += g_k
                t[kv_rows, 1] += g_v

            self.add(fn, kv_heads)

        return add_call

    def adder(self, kv_heads: slice = slice(None)) -> Callable[[AddInto], None]:
        """``add`` on ``kv_heads`` (a varlen call's)."""
        return lambda fn: self.add(fn, kv_heads)
