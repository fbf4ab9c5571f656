"""The attention one CP group runs: ``AttnShape`` (per rank, Megatron layout)."""

from __future__ import annotations

from dataclasses import dataclass

from ..accounting import LocalShape
from ..schedule.packing import PackedLayout
from .cluster import ModelSpec

__all__ = ["AttnShape"]


@dataclass(frozen=True)
class AttnShape:
    """The attention one CP group runs (Megatron layout, per rank)."""

    cp_size: int
    s_local: int
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    elem_bytes: int = 2
    """Input dtype bytes (bf16: 2)."""
    acc_bytes: int = 4
    """Accumulation dtype bytes (fp32: 4; fp64 runs: 8)."""
    causal: bool = True
    packed: PackedLayout | None = None
    """Packed documents (``packing.pack_lengths``): StarTrail's compute counts the
    per-document calls it makes; its bytes are those of the padded ``s_local``. The peers
    are charged as dense sequences (they take no document boundaries)."""
    window: tuple[int, int] | None = None
    """A sliding window ``(left, right)`` (``startrail_attention(window=)``): StarTrail's
    compute counts the windowed calls (``schedule.startrail_step_window_rows``, per
    document with ``packed``) at the pairs inside their band, and its bytes and ring steps
    only the sub-ring steps some rank computes (``active_steps``: K,V goes straight past
    idle ones). The all-gather and Ulysses peers are charged the window's pairs too (a
    windowed kernel in their calls; their bytes do not change)."""
    varlen: bool = False
    """With ``packed``: the kernel takes all documents of one block-plan call at once
    (flash-attn's varlen functions, TE's THD format), so a step costs one call's overhead
    per grouped call (``schedule.startrail_step_varlen``), not one per document."""

    def __post_init__(self) -> None:
        for f in ("cp_size", "s_local", "batch", "heads_q", "heads_kv", "head_dim", "elem_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}={v!r} must be an integer >= 1")
        if self.packed is not None and (
            self.packed.cp_size != self.cp_size or self.packed.s_local != self.s_local
        ):
            raise ValueError(
                f"packed is laid out for cp_size {self.packed.cp_size}, s_local "
                f"{self.packed.s_local}; this shape has {self.cp_size}, {self.s_local}"
            )
        if self.varlen and self.packed is None:
            raise ValueError("varlen=True describes packed documents: give packed= as well")
        if self.causal and self.s_local % 2:
            raise ValueError(
                f"causal zigzag needs an even s_local (sequence / cp_size), got {self.s_local}"
            )

    @classmethod
    def for_model(
        cls, model: ModelSpec, seq_len: int, cp_size: int, batch: int = 1, **kw
    ) -> AttnShape:
        if seq_len % (2 * cp_size):
            raise ValueError(
                f"seq_len={seq_len} must be divisible by 2*cp_size = {2 * cp_size} (zigzag)"
            )
        kw.setdefault("causal", model.causal)
        return cls(
            cp_size, seq_len // cp_size, batch, model.heads, model.kv_heads, model.head_dim, **kw
        )

    @property
    def band(self) -> tuple[int | None, int | None] | None:
        """The window normalized for this sequence (``None``: it masks nothing)."""
        from ..schedule import normalize_window

        return normalize_window(self.window, self.seq_len, self.causal)

    @property
    def seq_len(self) -> int:
        return self.s_local * self.cp_size

    def active_steps(self, lay):
        """The sub-ring steps each sub-ring of ``lay`` computes under this shape's window
        (``schedule.startrail_active_steps``; ``None``: all)."""
        from ..schedule import startrail_active_steps

        return startrail_active_steps(lay, self.causal, self.s_local, self.band, self.packed)

    @property
    def local(self) -> LocalShape:
        """One rank's tensors, the shape argument of ``accounting``."""
        return LocalShape(
            self.s_local,
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            self.elem_bytes,
            self.acc_bytes,
        )
