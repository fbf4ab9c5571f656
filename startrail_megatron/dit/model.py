"""A small diffusion transformer in plain PyTorch: DiT (Peebles & Xie, 2023) and an
SD3-style MMDiT variant with joint text-image attention.

Nothing here knows about StarTrail: attention is ``F.scaled_dot_product_attention`` on
``[batch, heads, tokens, head_dim]`` and the tokens pass through ``self.token_hooks``
(identity by default). ``parallel.parallelize_dit`` shards the tokens after patchify and
wraps every attention module, which is exactly what a user does to their own DiT.

Shapes: images ``[B, C, H, W]`` (``frames > 1``: video latents ``[B, C, F, H, W]``), patch
``p``; tokens ``N = F * (H/p) * (W/p)``; the model predicts the noise per token:
``[B, N_local, p*p*C]`` (compare with ``patchify(noise)``, sharded alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DiT", "DiTConfig", "patchify", "unpatchify"]


@dataclass(frozen=True)
class DiTConfig:
    """A DiT. ``text_tokens > 0`` makes joint (MMDiT) blocks that attend over
    ``[text; image]``; the text comes as ``context [B, text_tokens, text_dim]``."""

    height: int = 16
    width: int = 16
    frames: int = 1
    patch_size: int = 2
    in_channels: int = 4
    hidden_size: int = 64
    depth: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    num_classes: int = 10
    class_dropout_prob: float = 0.1
    text_tokens: int = 0
    text_dim: int = 32

    def __post_init__(self) -> None:
        p = self.patch_size
        if self.height % p or self.width % p:
            raise ValueError(
                f"height={self.height} and width={self.width} must be multiples of patch_size={p}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )

    @property
    def num_tokens(self) -> int:
        p = self.patch_size
        return self.frames * (self.height // p) * (self.width // p)

    @property
    def patch_dim(self) -> int:
        return self.patch_size**2 * self.in_channels


def patchify(x: Tensor, p: int) -> Tensor:
    """``[B, C, H, W]`` or ``[B, C, F, H, W]`` -> tokens ``[B, N, p*p*C]`` (frame-major,
    then rows, then columns)."""
    if x.dim() == 4:
        x = x.unsqueeze(2)
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f, h // p, p, w // p, p)
    return x.permute(0, 2, 3, 5, 4, 6, 1).reshape(b, f * (h // p) * (w // p), p * p * c)


def unpatchify(tokens: Tensor, cfg: DiTConfig) -> Tensor:
    """Inverse of ``patchify`` for the whole token sequence."""
    p, c = cfg.patch_size, cfg.in_channels
    b = tokens.shape[0]
    hp, wp = cfg.height // p, cfg.width // p
    x = tokens.reshape(b, cfg.frames, hp, wp, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)
    x = x.reshape(b, c, cfg.frames, cfg.height, cfg.width)
    return x.squeeze(2) if cfg.frames == 1 else x


def _sincos(n: int, dim: int) -> Tensor:
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    emb = torch.zeros(n, dim, dtype=torch.float64)
    emb[:, 0::2], emb[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return emb


def pos_embed(cfg: DiTConfig) -> Tensor:
    """Fixed sin-cos position embedding ``[N, hidden]``: a third of the channels per axis
    (frame, row, column), as DiT / Latte do (float64; the model casts it)."""
    p, h = cfg.patch_size, cfg.hidden_size
    f, hp, wp = cfg.frames, cfg.height // p, cfg.width // p
    dims = [2 * (h // 6)] * 2
    dims = [h - sum(dims), *dims]
    grids = torch.meshgrid(torch.arange(f), torch.arange(hp), torch.arange(wp), indexing="ij")
    parts = [_sincos(n, dd)[g.reshape(-1)] for n, dd, g in zip((f, hp, wp), dims, grids)]
    return torch.cat(parts, dim=1)


def timestep_embedding(t: Tensor, dim: int = 256) -> Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    args = t.double()[:, None] * freqs.to(t.device)[None]
    return torch.cat((torch.cos(args), torch.sin(args)), dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    """Multi-head self-attention (or the joint attention of one MMDiT stream pair) through
    ``F.scaled_dot_product_attention``: what ``parallel.wrap_attention`` replaces."""

    def __init__(self, dim: int, heads: int, joint: bool = False, text_out: bool = True):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        if joint:  # the text stream's own projections (SD3)
            self.qkv_txt = nn.Linear(dim, 3 * dim)
            self.proj_txt = nn.Linear(dim, dim) if text_out else None

    def _heads(self, x: Tensor, lin: nn.Linear) -> tuple[Tensor, Tensor, Tensor]:
        b, n, c = x.shape
        qkv = lin(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # [b, h, n, d] each

    def forward(self, x: Tensor, txt: Tensor | None = None):
        b, n, c = x.shape
        q, k, v = self._heads(x, self.qkv)
        if txt is None:
            o = F.scaled_dot_product_attention(q, k, v)
            return self.proj(o.transpose(1, 2).reshape(b, n, c))
        t = txt.shape[1]
        qt, kt, vt = self._heads(txt, self.qkv_txt)
        # SD3 / Flux order: text first, one attention over the concatenation
        o = F.scaled_dot_product_attention(
            torch.cat((qt, q), 2), torch.cat((kt, k), 2), torch.cat((vt, v), 2)
        )
        o = o.transpose(1, 2)
        out_txt = None if self.proj_txt is None else self.proj_txt(o[:, :t].reshape(b, t, c))
        return self.proj(o[:, t:].reshape(b, n, c)), out_txt


def _mlp(dim: int, ratio: float) -> nn.Sequential:
    hidden = int(dim * ratio)
    return nn.Sequential(
        nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim)
    )


class _Stream(nn.Module):
    """adaLN-Zero around an attention output and an MLP (one stream of a block).
    ``pre_only``: the text stream of the last MMDiT block, which only feeds its K,V to the
    image tokens (SD3's ``context_pre_only``): no attention output, no MLP."""

    def __init__(self, dim: int, ratio: float, pre_only: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.n_mods = 2 if pre_only else 6
        if not pre_only:
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.mlp = _mlp(dim, ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, self.n_mods * dim))

    def pre(self, x: Tensor, c: Tensor):
        mods = self.adaLN_modulation(c).chunk(self.n_mods, dim=1)
        return modulate(self.norm1(x), mods[0], mods[1]), mods

    def post(self, x: Tensor, attn_out: Tensor, mods) -> Tensor:
        x = x + mods[2].unsqueeze(1) * attn_out
        return x + mods[5].unsqueeze(1) * self.mlp(modulate(self.norm2(x), mods[3], mods[4]))


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ratio: float, joint: bool, last: bool = False):
        super().__init__()
        self.joint = joint
        self.img = _Stream(dim, ratio)
        self.attn = Attention(dim, heads, joint, text_out=not last)
        if joint:
            self.txt = _Stream(dim, ratio, pre_only=last)

    def forward(self, x: Tensor, c: Tensor, txt: Tensor | None):
        h, mods = self.img.pre(x, c)
        if not self.joint:
            return self.img.post(x, self.attn(h), mods), None
        ht, mods_t = self.txt.pre(txt, c)
        a, a_t = self.attn(h, ht)
        txt = None if a_t is None else self.txt.post(txt, a_t, mods_t)
        return self.img.post(x, a, mods), txt


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiT(nn.Module):
    """``forward(x, t, y, context=None)``: noisy latents, timesteps ``[B]``, class labels
    ``[B]`` (``num_classes`` is the dropped / unconditional label), optional text
    ``[B, text_tokens, text_dim]`` -> the predicted noise per (local) token."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        dim = cfg.hidden_size
        self.x_embedder = nn.Linear(cfg.patch_dim, dim)
        self.t_embedder = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_embedder = nn.Embedding(cfg.num_classes + 1, dim)
        joint = cfg.text_tokens > 0
        if joint:
            self.context_embedder = nn.Linear(cfg.text_dim, dim)
        self.register_buffer("pos_embed", pos_embed(cfg).float(), persistent=False)
        self.blocks = nn.ModuleList(
            DiTBlock(dim, cfg.num_heads, cfg.mlp_ratio, joint, last=i == cfg.depth - 1)
            for i in range(cfg.depth)
        )
        self.final_layer = FinalLayer(dim, cfg.patch_dim)
        self.token_hooks = None  # parallel.TokenSharding when parallelized
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's initialisation: Xavier linears, adaLN modulations and the output zero
        (adaLN-Zero: every block starts as the identity)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.y_embedder.weight, std=0.02)
        for m in self.modules():
            if hasattr(m, "adaLN_modulation"):
                nn.init.zeros_(m.adaLN_modulation[-1].weight)
                nn.init.zeros_(m.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def forward(self, x: Tensor, t: Tensor, y: Tensor, context: Tensor | None = None) -> Tensor:
        cfg = self.cfg
        if (context is None) != (cfg.text_tokens == 0):
            raise ValueError(
                f"context must be given exactly when text_tokens > 0 (text_tokens = "
                f"{cfg.text_tokens}, context {'missing' if context is None else 'given'})"
            )
        tokens = self.x_embedder(patchify(x, cfg.patch_size)) + self.pos_embed.to(x.dtype)
        if self.token_hooks is not None:
            tokens = self.token_hooks.shard(tokens)  # this rank's tokens, after patchify
        c = self.t_embedder(timestep_embedding(t).to(x.dtype)) + self.y_embedder(y)
        txt = None if context is None else self.context_embedder(context)
        for block in self.blocks:
            tokens, txt = block(tokens, c, txt)
        return self.final_layer(tokens, c)
