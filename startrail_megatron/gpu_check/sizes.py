"""The gpu_check's modes: the backends it checks and times, the sizes of the GPU and the
CPU mode, and the peers' tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CHECK_BACKENDS", "CPU_SIZES", "GPU_SIZES", "TIMED_BACKENDS", "Sizes", "tolerance"]

CHECK_BACKENDS = (
    "flash_attn",
    "sdpa_flash",
    "sdpa_cudnn",
    "sdpa_efficient",
    "te",
    "sdpa",
    "torch",
)
TIMED_BACKENDS = ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "te", "sdpa")


@dataclass(frozen=True)
class Sizes:
    """The sizes of one mode.

    Attributes:
        check_layouts: (P, C, causal) of the correctness checks.
        check_heads: (heads_q, heads_kv) pairs checked (MHA and GQA).
        check_s_local, check_batch, check_head_dim: tokens per rank, batch, head_dim.
        dtypes: the input dtypes checked (and the first one timed).
        time_p, time_cs: P and the team sizes timed.
        time_s_local, time_heads, time_head_dim, time_batch: the timed shapes.
        reps, warmup: timed repetitions after untimed warm-up ones.
    """

    check_layouts: tuple[tuple[int, int, bool], ...]
    check_heads: tuple[tuple[int, int], ...]
    check_s_local: int
    check_batch: int
    check_head_dim: int
    dtypes: tuple[torch.dtype, ...]
    time_p: int
    time_cs: tuple[int, ...]
    time_s_local: int
    time_heads: tuple[int, int]
    time_head_dim: int
    time_batch: int = 1
    reps: int = 3
    warmup: int = 1


GPU_SIZES = Sizes(
    check_layouts=((8, 2, True), (8, 1, True), (4, 2, False)),
    check_heads=((16, 16), (16, 4)),
    check_s_local=256,
    check_batch=1,
    check_head_dim=128,
    dtypes=(torch.bfloat16, torch.float16),
    time_p=8,
    time_cs=(1, 2),
    time_s_local=8192,
    time_heads=(32, 8),
    time_head_dim=128,
)
CPU_SIZES = Sizes(
    check_layouts=((4, 2, True), (4, 1, False)),
    check_heads=((4, 4), (4, 2)),
    check_s_local=8,
    check_batch=1,
    check_head_dim=32,
    dtypes=(torch.bfloat16, torch.float16),
    time_p=4,
    time_cs=(1, 2),
    time_s_local=32,
    time_heads=(4, 2),
    time_head_dim=32,
    reps=1,
)


def tolerance(dtype: torch.dtype, gqa: bool) -> float:
    """The peers' tolerance on max relative error: bf16 2.5e-2 (MHA) / 3.5e-2 (GQA), fp16 5e-3."""
    if dtype == torch.bfloat16:
        return 3.5e-2 if gqa else 2.5e-2
    if dtype == torch.float16:
        return 5e-3
    return 1e-5 if dtype == torch.float32 else 1e-10
