"""The DiT trainer's data: synthetic class-conditional images and each replica's stream of
diffusion inputs (DDPM, epsilon prediction, linear betas, 1000 steps), so it runs anywhere
with no download."""

from __future__ import annotations

import torch
from torch import Tensor

from .model import DiTConfig

__all__ = ["ReplicaBatches", "alphas_cumprod", "synthetic_images"]


def alphas_cumprod(steps: int = 1000) -> Tensor:
    """DDPM's linear beta schedule (1e-4 .. 0.02), cumulative products, float64."""
    return torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps, dtype=torch.float64), 0)


def synthetic_images(cfg: DiTConfig, seed: int, per_class: int = 4) -> tuple[Tensor, Tensor]:
    """(images ``[K*per_class, C, (F,) H, W]``, labels): each class a smooth pattern of its
    own frequencies, each image a shifted copy plus a little noise (float64)."""
    g = torch.Generator().manual_seed(seed)
    k = cfg.num_classes
    yy, xx = torch.meshgrid(
        torch.linspace(0, 1, cfg.height, dtype=torch.float64),
        torch.linspace(0, 1, cfg.width, dtype=torch.float64),
        indexing="ij",
    )
    freq = 1 + 3 * torch.rand(k, cfg.in_channels, 2, generator=g, dtype=torch.float64)
    imgs, labels = [], []
    for c in range(k):
        for _ in range(per_class):
            ph = 6.28 * torch.rand(cfg.in_channels, 1, 1, generator=g, dtype=torch.float64)
            img = torch.sin(
                6.28 * (freq[c, :, 0, None, None] * xx + freq[c, :, 1, None, None] * yy) + ph
            )
            if cfg.frames > 1:
                img = torch.stack([img.roll(f, dims=-1) for f in range(cfg.frames)], dim=1)
            imgs.append(img + 0.05 * torch.randn(img.shape, generator=g, dtype=torch.float64))
            labels.append(c)
    return torch.stack(imgs), torch.tensor(labels)


class ReplicaBatches:
    """One replica's stream of diffusion inputs: per step (x_t, t, y, context, noise).

    Drawn from a generator seeded by (seed, replica): the same on every rank of the
    replica, different across replicas. ``context``: per-class text embeddings (fixed
    from ``seed``) with ``text_tokens`` tokens, or ``None``."""

    def __init__(self, cfg: DiTConfig, seed: int, replica: int, batch: int, dtype: torch.dtype):
        self.cfg, self.batch, self.dtype = cfg, batch, dtype
        self.images, self.labels = synthetic_images(cfg, seed)
        self.abar = alphas_cumprod()
        g = torch.Generator().manual_seed(seed + 7919)
        self.text = (
            torch.randn(
                cfg.num_classes + 1, cfg.text_tokens, cfg.text_dim, generator=g, dtype=torch.float64
            )
            if cfg.text_tokens
            else None
        )
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + 17 * replica + 1)

    def next(self) -> dict[str, Tensor]:
        g, cfg = self.gen, self.cfg
        idx = torch.randint(0, len(self.images), (self.batch,), generator=g)
        t = torch.randint(0, len(self.abar), (self.batch,), generator=g)
        x0 = self.images[idx]
        noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
        drop = torch.rand(self.batch, generator=g, dtype=torch.float64) < cfg.class_dropout_prob
        y = torch.where(drop, torch.full_like(self.labels[idx], cfg.num_classes), self.labels[idx])
        ab = self.abar[t].view(-1, *[1] * (x0.dim() - 1))
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        out = {"x": xt.to(self.dtype), "t": t, "y": y, "noise": noise.to(self.dtype)}
        out["context"] = None if self.text is None else self.text[y].to(self.dtype)
        return out
