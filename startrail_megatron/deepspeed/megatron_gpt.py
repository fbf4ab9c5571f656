"""A megatron-core ``GPTModel`` trained by DeepSpeed with StarTrail.

The model comes from the Megatron integration: Megatron's parallel state with
``context_parallel_size = P`` and StarTrail's groups (``megatron.install`` or
the DeepSpeed launcher, which installs it when megatron-core is present), and
a layer spec whose core attention is ``StarTrailCoreAttention``.
``prepare_megatron_gpt`` then makes the model look, to an unmodified training
loop, like a model of the whole sequence:

* a forward pre-hook cuts full-length ``input_ids``, ``position_ids`` and
  ``labels`` ``[b, s]`` into this CP rank's zigzag shard (the P ranks of a
  replica must be given the same batch; checked); a packed row (one row whose
  position ids restart at 0 per document) is cut per document instead and the
  model gets its ``PackedSeqParams(qkv_format="thd")``;
* a forward hook all-gathers the output (per-token losses ``[b, s_local]`` or
  logits ``[b, s_local, V]``) over the CP group and restores sequence order,
  so ``loss = (losses * loss_mask).sum() / loss_mask.sum()`` is the exact
  global value on every rank. Its backward keeps this rank's slice of the
  incoming gradient: each rank's parameter gradient is that of the global loss
  through its own tokens, and the sum over the CP group is the full gradient.

DeepSpeed (ZeRO 0/1/2) divides the sum over sequence x data ranks by the data
ranks D, which is then exactly right; ZeRO-3 divides by P*D, so ``grad_scale``
is P there (set by ``initialize``), as for the Hugging Face path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..schedule.packing import PackedLayout
from ..zigzag import shard_packed, unshard_packed, zigzag_shard, zigzag_unshard
from .batches import check_same_batch, packed_row_layout
from .config import StarTrailConfig
from .hf import ScaleGrad
from .mpu import StarTrailMPU

__all__ = ["is_megatron_gpt", "megatron_mpu", "prepare_megatron_gpt"]


def is_megatron_gpt(model: nn.Module) -> bool:
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError:
        return False
    return isinstance(model, GPTModel)


def megatron_mpu(config: StarTrailConfig) -> StarTrailMPU:
    """DeepSpeed's sequence-parallel mpu from Megatron's CP group and StarTrail's groups."""
    from megatron.core import parallel_state

    from ..megatron.registry import get_startrail_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "a megatron-core GPTModel needs Megatron's parallel state: call "
            "parallel_state.initialize_model_parallel(context_parallel_size="
            f"{config.sequence_parallel_size}) before building the model"
        )
    cp = parallel_state.get_context_parallel_world_size()
    if cp != config.sequence_parallel_size:
        raise ValueError(
            f"startrail.sequence_parallel_size={config.sequence_parallel_size} differs from "
            f"Megatron's context_parallel_size={cp}; allowed: {cp}"
        )
    for name, size in (
        ("tensor", parallel_state.get_tensor_model_parallel_world_size()),
        ("pipeline", parallel_state.get_pipeline_model_parallel_world_size()),
    ):
        if size != 1:
            raise NotImplementedError(
                f"a megatron-core GPTModel in DeepSpeed with {name} parallel size {size}: only 1 "
                "is supported (use the Megatron entry point for TP/PP)"
            )
    cp_group = parallel_state.get_context_parallel_group()
    groups = get_startrail_state(cp_group).groups
    lay = groups.layout
    ulysses = getattr(lay, "ulysses_size", 1)
    want = (config.team_size, config.placement, config.ulysses_size)
    ran = lay.placement
    if config.placement == "auto" and isinstance(ran, tuple):
        ran = "auto"  # a computed map: the Megatron groups were made with 'auto' too
    if (lay.team_size, ran, ulysses) != want:
        raise ValueError(
            f"startrail.team_size={config.team_size}, placement={config.placement!r}, "
            f"ulysses_size={config.ulysses_size} differ from the Megatron StarTrail groups "
            f"(team_size={lay.team_size}, placement={lay.placement!r}, ulysses_size={ulysses}); "
            "build both from the same setting"
        )
    if config.own_rows_first != "auto" and groups.own_rows_first != config.own_rows_first_value:
        raise ValueError(
            f"startrail.own_rows_first={config.own_rows_first!r} differs from the Megatron "
            f"StarTrail groups' own_rows_first={groups.own_rows_first!r}; pass "
            "install(..., own_rows_first=) the same setting (the DeepSpeed launcher does)"
        )
    return StarTrailMPU(
        config,
        cp_group,
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        groups,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )


class _GatherSequence(torch.autograd.Function):
    """[b, s_local, ...] shards -> [b, s, ...] on every CP rank; backward: own slice.

    Zigzag shards, or with ``packed`` the per-document shards of one packed row (the
    padding dropped on the way out, zero gradient on it on the way back)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, rank: int, size: int, packed=None):
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.size, ctx.packed = rank, size, packed
        if packed is not None:
            return unshard_packed(parts, packed, dim=1)
        return zigzag_unshard(parts, dim=1)

    @staticmethod
    def backward(ctx, g: Tensor):
        if ctx.packed is not None:
            local = shard_packed(g, ctx.packed, ctx.rank, dim=1)
        else:
            local = zigzag_shard(g, ctx.rank, ctx.size, dim=1)
        return local.contiguous(), None, None, None, None


_ARG_NAMES = ("input_ids", "position_ids", "attention_mask")


@dataclass
class MegatronHandle:
    """What ``prepare_megatron_gpt`` changed; ``remove()`` undoes it."""

    model: nn.Module
    mpu: StarTrailMPU
    grad_scale: float = 1.0
    packed: PackedLayout | None = None
    """The documents of the packed row in the forward now running (None: not packed)."""
    _hooks: list = field(default_factory=list)
    _unmarked: list = field(default_factory=list)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for p in self._unmarked:
            p.tensor_model_parallel = True
        self._hooks, self._unmarked = [], []

    def _pre_hook(self, module, args, kwargs):
        if any(a is not None for a in args[len(_ARG_NAMES) :]):  # 4th decoder_input, 5th labels
            raise ValueError(
                f"pass GPTModel's arguments after {', '.join(_ARG_NAMES)} by keyword (labels=...): "
                f"got {len(args)} positional ones, and StarTrail's adapter reads the first "
                f"{len(_ARG_NAMES)} only"
            )
        args = list(args)
        for i, name in enumerate(_ARG_NAMES[: len(args)]):
            kwargs[name] = args[i]
        args = []
        if kwargs.get("decoder_input") is not None:
            raise ValueError(
                "decoder_input (embeddings of the full sequence) is not supported with "
                "StarTrail's adapter: pass input_ids, which it shards over the sequence ranks"
            )
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                "pass attention_mask=None: StarTrail's causal attention needs no mask tensor "
                "(padding masks are not supported)"
            )
        if kwargs.get("packed_seq_params") is not None:
            raise ValueError(
                "pass packed documents as position_ids restarting at 0 per document (one row); "
                "the adapter builds packed_seq_params from the full row itself"
            )
        mpu = self.mpu
        p, r = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
        ids = kwargs["input_ids"]
        check_same_batch(ids, mpu.sequence_parallel_group)
        self.packed = packed_row_layout(kwargs.get("position_ids"), ids.shape, p)
        for name in ("input_ids", "position_ids", "labels"):
            if kwargs.get(name) is not None:
                if self.packed is not None:
                    kwargs[name] = shard_packed(kwargs[name], self.packed, r, dim=1)
                else:
                    kwargs[name] = zigzag_shard(kwargs[name], r, p, dim=1)
        if self.packed is not None:
            from ..megatron.attention import packed_seq_params

            kwargs["packed_seq_params"] = packed_seq_params(self.packed, ids.device)
        return tuple(args), kwargs

    def _post_hook(self, module, args, kwargs, output):
        if not isinstance(output, Tensor):
            raise NotImplementedError(
                f"StarTrail's GPTModel adapter expects a tensor output, got {type(output).__name__}"
            )
        mpu = self.mpu
        packed, self.packed = self.packed, None
        out = _GatherSequence.apply(
            output,
            mpu.sequence_parallel_group,
            mpu.get_sequence_parallel_rank(),
            mpu.get_sequence_parallel_world_size(),
            packed,
        )
        return ScaleGrad.apply(out, self.grad_scale) if self.grad_scale != 1.0 else out


def prepare_megatron_gpt(model: nn.Module, mpu: StarTrailMPU) -> MegatronHandle:
    """Hook a StarTrail GPTModel so an unmodified loop feeds and reads full sequences."""
    from ..megatron.attention import StarTrailCoreAttention

    if not any(isinstance(m, StarTrailCoreAttention) for m in model.modules()):
        raise ValueError(
            "this GPTModel has no StarTrail attention: build it with "
            "startrail_megatron.megatron.apply_startrail_spec(spec) or after "
            "startrail_megatron.megatron.install(team_size=...) (the DeepSpeed launcher does "
            "this when megatron-core is installed)"
        )
    handle = MegatronHandle(model, mpu)
    # Megatron marks its linear weights ``tensor_model_parallel`` even at TP = 1 (the only
    # size this path runs). DeepSpeed's sequence-parallel mpu aliases model parallel to the
    # sequence group, so its non-ZeRO gradient clipping (ZeRO-0; also its fp16/bf16
    # optimizers) would count such a weight's norm once per sequence rank: the norm P times
    # too large in square, the clipped step wrong. At TP = 1 no weight is split: unmark them.
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            p.tensor_model_parallel = False
            handle._unmarked.append(p)
    handle._hooks.append(model.register_forward_pre_hook(handle._pre_hook, with_kwargs=True))
    handle._hooks.append(model.register_forward_hook(handle._post_hook, with_kwargs=True))
    return handle
