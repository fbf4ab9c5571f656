"""StarTrail for diffusion transformers: token sharding after patchify, the attention
wrapper, the run-time check that a group's randomness agrees, and the loss scale.

Layout. Full attention has no causal imbalance, so any token layout is balanced; we use
the per-document zigzag layout of one document (``packing.pack_lengths([N], P)``:
rank r holds chunks r and 2P-1-r of 2P). For N a multiple of 2P that is plain zigzag and
StarTrail runs its dense path (for full attention the order of the rows does not matter);
for any other N the sequence is padded to the next multiple of 2P and the core's tested
padding path runs: padding keys masked, padding rows zero output and zero gradient, left
out of the loss (``TokenSharding.real``). So an uneven resolution needs no second code
path and is never silently wrong.

A user's own DiT gets StarTrail by sharding its tokens after patchify and wrapping its
attention modules (Note [wrapping attention]); ``parallelize_dit`` does both for
``model.DiT``::

    groups = StarTrailGroups.create(team_size=2, cp_group=cp_group)
    tokens = TokenSharding(groups)
    sdpa = StarTrailSDPA(groups, tokens, joint_tokens=77)   # 0 without text tokens
    for block in my_dit.blocks:
        wrap_attention(block.attn, sdpa)
    # in my_dit.forward, after patchify + position embedding:
    x = tokens.shard(x)                                      # [B, N, C] -> [B, s_local, C]
    ...
    loss = diffusion_loss(pred_local, tokens.shard(patchify(noise)), tokens, grad_reduction)

Note [wrapping attention]
~~~~~~~~~~~~~~~~~~~~~~~~~
``wrap_attention(module, sdpa)`` runs the module's forward with
``torch.nn.functional.scaled_dot_product_attention`` replaced by ``sdpa`` (restored
afterwards, also on error), which is how timm's ``Attention`` (DiT), diffusers'
``AttnProcessor2_0`` and most DiT code call attention. ``sdpa`` takes SDPA's arguments
(``[B, H, L, D]``; ``attn_mask`` and ``is_causal`` refused by name) and runs StarTrail over
the CP group. A module that calls SDPA by another name (imported before wrapping, a fused
kernel) would silently attend to its local tokens only: the wrapper therefore raises if
the wrapped forward made no call to ``sdpa``.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import startrail_attention
from ..comm import CommLedger, TeamComm, check_agreement
from ..groups import StarTrailGroups
from ..joint import joint_attention
from ..kernels import AttentionKernel
from ..schedule.packing import PackedLayout, pack_lengths
from ..zigzag import shard_packed, unshard_packed

__all__ = [
    "DiTHandle",
    "StarTrailSDPA",
    "TokenSharding",
    "check_replicated",
    "diffusion_loss",
    "parallelize_dit",
    "wrap_attention",
]


class TokenSharding:
    """The image tokens of one CP group: per-document zigzag shards of one document of N
    tokens (padded to a multiple of 2P). ``shard`` sets N from the tokens it is given, so
    a new resolution needs nothing else; ``layout`` is the current one."""

    def __init__(self, groups: StarTrailGroups):
        self.groups = groups
        self.layout: PackedLayout | None = None

    def _set(self, n: int) -> PackedLayout:
        if self.layout is None or self.layout.cu_seqlens[-1] != n:
            self.layout = pack_lengths([n], self.groups.cp_size)
        return self.layout

    def _current(self) -> PackedLayout:
        if self.layout is None:
            raise RuntimeError("TokenSharding: no tokens sharded yet (call shard() first)")
        return self.layout

    @property
    def num_tokens(self) -> int:
        return self._current().cu_seqlens[-1]

    @property
    def s_local(self) -> int:
        return self._current().s_local

    @property
    def padded(self) -> bool:
        lay = self._current()
        return lay.total != lay.cu_seqlens[-1]

    def attention_kwargs(self) -> dict:
        """``cu_seqlens`` for StarTrail when the tokens are padded (else none)."""
        lay = self._current()
        if not self.padded:
            return {}
        return {"cu_seqlens": lay.cu_seqlens, "cu_seqlens_padded": lay.cu_seqlens_padded}

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of the full ``x`` (the same on every rank of the group),
        padding rows zero. Differentiable: the gradient of ``x`` is this rank's part."""
        lay = self._set(x.shape[dim])
        return shard_packed(x, lay, self.groups.cp_rank, dim=dim)

    def real(self, device: torch.device | str = "cpu") -> Tensor:
        """``[s_local]`` bool: which local rows are real tokens (not padding)."""
        lay = self._current()
        mask = torch.zeros(lay.s_local, dtype=torch.bool)
        mask[list(lay.real_rows(self.groups.cp_rank))] = True
        return mask.to(device)

    def gather(self, x: Tensor, dim: int = 1, ledger: CommLedger | None = None) -> Tensor:
        """The full token sequence from every rank's shard (one all-gather over the CP
        group; for sampling and unpatchify, not differentiable)."""
        lay, p = self._current(), self.groups.cp_size
        xd = x.detach().movedim(dim, 0).contiguous()
        allx = TeamComm(self.groups.cp_group, p, ledger).all_gather(xd, "tokens")
        return unshard_packed(list(allx.chunk(p)), lay).movedim(0, dim)


class StarTrailSDPA:
    """``torch.nn.functional.scaled_dot_product_attention``'s signature over the CP group.

    Inputs ``[B, H, L, D]`` with ``L = joint_tokens + s_local``: the first ``joint_tokens``
    rows are replicated text tokens (MMDiT; ``joint.joint_attention``), the rest this
    rank's image tokens in ``tokens``' layout. ``calls`` counts the calls (the proof that
    StarTrail ran); ``ledger`` records every transfer.
    """

    def __init__(
        self,
        groups: StarTrailGroups,
        tokens: TokenSharding,
        joint_tokens: int = 0,
        kernel: str | AttentionKernel = "auto",
        ledger: CommLedger | None = None,
    ):
        if not isinstance(joint_tokens, int) or isinstance(joint_tokens, bool) or joint_tokens < 0:
            raise ValueError(f"joint_tokens must be an integer >= 0, got {joint_tokens!r}")
        self.groups, self.tokens, self.joint_tokens = groups, tokens, joint_tokens
        self.kernel, self.ledger = kernel, ledger if ledger is not None else CommLedger()
        self.calls = 0

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if attn_mask is not None:
            raise ValueError(
                "StarTrailSDPA: attn_mask is not supported (full attention over the sharded "
                "tokens; padding is masked from the token count): pass attn_mask=None"
            )
        if is_causal:
            raise ValueError(
                "StarTrailSDPA: is_causal=True is not supported (DiT attention is full)"
            )
        t, s = self.joint_tokens, self.tokens.s_local
        if query.dim() != 4 or query.shape[2] != t + s:
            raise ValueError(
                f"StarTrailSDPA: query {tuple(query.shape)} must be [B, H, joint_tokens + "
                f"s_local, D] = [B, H, {t} + {s}, D]: shard the image tokens (TokenSharding) "
                "and set joint_tokens to the replicated text tokens in front"
            )
        hq, hkv = query.shape[1], key.shape[1]
        if hq != hkv and not enable_gqa:
            raise ValueError(f"query has {hq} heads, key {hkv}: pass enable_gqa=True for GQA")
        q, k, v = (x.permute(2, 0, 1, 3).contiguous() for x in (query, key, value))
        kw = dict(
            softmax_scale=scale, kernel=self.kernel, ledger=self.ledger,
            **self.tokens.attention_kwargs(),
        )  # fmt: skip
        self.calls += 1
        if t == 0:
            out = startrail_attention(q, k, v, self.groups, causal=False, dropout_p=dropout_p, **kw)
        else:
            if dropout_p:
                raise ValueError(
                    f"StarTrailSDPA: dropout_p={dropout_p} with joint tokens is not supported; "
                    "allowed: 0"
                )
            o_img, o_txt = joint_attention(
                q[t:], k[t:], v[t:], q[:t], k[:t], v[:t], self.groups, **kw
            )
            out = torch.cat((o_txt, o_img))
        return out.permute(1, 2, 0, 3)


_swap = threading.local()


@contextlib.contextmanager
def _sdpa_replaced(sdpa: StarTrailSDPA):
    prev = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    _swap.depth = getattr(_swap, "depth", 0) + 1
    try:
        yield
    finally:
        _swap.depth -= 1
        F.scaled_dot_product_attention = prev


def wrap_attention(module: nn.Module, sdpa: StarTrailSDPA) -> nn.Module:
    """Run ``module``'s forward with SDPA replaced by ``sdpa`` (Note [wrapping attention]);
    ``unwrap_attention`` undoes it. Returns the module."""
    if hasattr(module, "_startrail_forward"):
        raise ValueError(f"{type(module).__name__} is already wrapped (unwrap_attention first)")
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        before = sdpa.calls
        with _sdpa_replaced(sdpa):
            out = inner(*args, **kwargs)
        if sdpa.calls == before:
            raise RuntimeError(
                f"{type(module).__name__}.forward made no call to "
                "torch.nn.functional.scaled_dot_product_attention, so StarTrail did not run "
                "(it would have attended to this rank's tokens only): call it as "
                "F.scaled_dot_product_attention, or call a StarTrailSDPA yourself"
            )
        return out

    module._startrail_forward = inner
    module.forward = forward
    return module


def unwrap_attention(module: nn.Module) -> nn.Module:
    inner = module.__dict__.pop("_startrail_forward", None)
    if inner is not None:
        module.__dict__.pop("forward", None)
    return module


class DiTHandle:
    """What ``parallelize_dit`` changed: ``tokens``, ``sdpa`` (its ``ledger`` and
    ``calls``), ``grad_scale`` (the loss factor for the gradient reduction in use);
    ``remove()`` undoes it."""

    def __init__(self, model, tokens: TokenSharding, sdpa: StarTrailSDPA, wrapped: list):
        self.model, self.tokens, self.sdpa, self._wrapped = model, tokens, sdpa, wrapped
        self.grad_scale = 1.0
        self._hook = model.register_forward_pre_hook(self._check_inputs, with_kwargs=True)

    def _check_inputs(self, module, args, kwargs):
        """Every rank of the group must pass the same full image, timesteps, labels and
        text (``check_replicated``): each keeps its share of the tokens, so ranks given
        other images would train on one stitched from them, silently."""
        names = {"x": "images", "t": "timesteps", "y": "labels", "context": "context"}
        given = {**dict(zip(names, args)), **kwargs}
        check_replicated(
            self.groups.cp_group,
            **{names[n]: given[n] for n in names if given.get(n) is not None},
        )

    @property
    def groups(self) -> StarTrailGroups:
        return self.tokens.groups

    def remove(self) -> None:
        for m in self._wrapped:
            unwrap_attention(m)
        self._wrapped = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.model.token_hooks = None
        if getattr(self.model, "_startrail_handle", None) is self:
            del self.model._startrail_handle


def parallelize_dit(
    model: nn.Module,
    groups: StarTrailGroups,
    *,
    kernel: str | AttentionKernel = "auto",
    ledger: CommLedger | None = None,
) -> DiTHandle:
    """Shard ``model.DiT``'s tokens after patchify and wrap every block's attention."""
    from .model import DiT

    if not isinstance(model, DiT):
        raise ValueError(
            f"parallelize_dit takes a startrail_megatron.dit.DiT, got {type(model).__name__}; "
            "for your own DiT use TokenSharding, StarTrailSDPA and wrap_attention"
        )
    if getattr(model, "_startrail_handle", None) is not None:
        raise ValueError("this DiT is already parallelized (handle.remove() first)")
    tokens = TokenSharding(groups)
    sdpa = StarTrailSDPA(groups, tokens, model.cfg.text_tokens, kernel=kernel, ledger=ledger)
    wrapped = [wrap_attention(b.attn, sdpa) for b in model.blocks]
    model.token_hooks = tokens
    handle = DiTHandle(model, tokens, sdpa, wrapped)
    model._startrail_handle = handle
    return handle


def _checksum(x: Tensor) -> int:
    """64 bits of a position-weighted float64 sum of ``x`` (and its shape)."""
    flat = x.detach().reshape(-1).to(torch.float64)
    w = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    h = float((flat * w).sum().item()) + sum((i + 1) * 1e-3 * n for i, n in enumerate(x.shape))
    return struct.unpack("<q", struct.pack("<d", h))[0]


def check_replicated(group, **tensors: Tensor) -> None:
    """``ValueError`` on every rank of ``group`` (a StarTrail CP group) unless each named
    tensor is the same on all its ranks: the noise, timesteps, labels (after the label
    drop) and text of a diffusion step must be, or every rank trains on another sample.
    One small all-reduce; reads the result on the host."""
    if not tensors:
        return
    device = next(iter(tensors.values())).device
    fields = {name: _checksum(t) for name, t in tensors.items()}
    check_agreement(
        group, fields, device,
        hint="the ranks of one StarTrail group must take the same images and draw the same "
        "noise, timesteps and label drop (seed the generator per data-parallel replica, not "
        "per rank)",
    )  # fmt: skip


def diffusion_loss(pred: Tensor, target: Tensor, tokens: TokenSharding, scale: float = 1.0):
    """This rank's part of the replica's mean squared error over real tokens:
    ``sum over local real tokens / (B * N * patch_dim) * scale``. Summed over the CP group it
    is the replica's MSE; ``scale`` undoes what the gradient reduction divides by (P for a
    mean over the CP group, as DDP over sequence x data ranks takes; 1 for DeepSpeed's
    ZeRO 0-2, which sums over the sequence ranks)."""
    acc = torch.promote_types(pred.dtype, torch.float32)  # bf16 outputs summed in fp32
    real = tokens.real(pred.device).view(1, -1, 1)
    err = ((pred.to(acc) - target.to(acc)) ** 2 * real).sum()
    return err * (scale / (pred.shape[0] * tokens.num_tokens * pred.shape[2]))
