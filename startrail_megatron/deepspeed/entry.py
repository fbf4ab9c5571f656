"""``initialize``: ``deepspeed.initialize`` with StarTrail sequence parallelism.

Same signature and return value as ``deepspeed.initialize``. With no enabled
``"startrail"`` section (or P = 1) it is a plain call of DeepSpeed's function
with the arguments untouched. Otherwise, before DeepSpeed sees anything:

1. validate the section (``ValueError`` naming ``startrail.<key>``) and the
   ZeRO settings it interacts with;
2. set the CUDA device to the local rank (``set_local_device``), create the
   groups (``StarTrailMPU``) and prepare the model (``prepare_hf_model``,
   ``prepare_megatron_gpt``, or ``dit.parallelize_dit`` for a ``dit.DiT``, whose
   loss is ``dit.diffusion_loss(..., scale=engine.startrail_handle.grad_scale)``);
3. call DeepSpeed with ``mpu=`` those groups and the config minus the section
   (plus ``zero_hpz_partition_size = C`` for ``zero_mapping: "hpz_team"``).

Gradient reduction (deepspeed 0.19.8, checked by the tests numerically):
ZeRO 0/1/2 and ZeRO-3 with ``reduce_scatter: false`` and contiguous buckets
divide the sum over sequence x data ranks by (sequence x data) / P = D,
which is right for our loss. ZeRO-3's default path
(``reduce_scatter_coalesced``) divides by sequence x data, i.e. P times too
much: ``initialize`` corrects it by scaling the model outputs' gradient by P
(``HFHandle.grad_scale``). ZeRO-3 with ``reduce_scatter: false`` picks
either path per bucket, so it is refused rather than trained wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from . import internals
from .config import STARTRAIL_KEY, StarTrailConfig
from .mpu import StarTrailMPU

__all__ = ["initialize", "resolve_config", "set_local_device"]


def resolve_config(args: Any = None, config: Any = None, config_params: Any = None) -> dict | None:
    """The config dict ``deepspeed.initialize`` would use (``args.deepspeed_config``,
    ``config`` or ``config_params``), or ``None`` if none is given (DeepSpeed then raises)."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    if config is None and config_params is not None:
        config = config_params
    for name in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, name, None)
        if value is not None:
            if config is not None:
                return None  # DeepSpeed refuses two configs; let it say so
            config = value
    if config is None:
        return None
    return copy.deepcopy(config) if isinstance(config, dict) else load_ds_config(config)


def set_local_device(args: Any = None) -> None:
    """On CUDA, make this process's current device its local rank's, as DeepSpeed's engine
    will (``_set_distributed_vars``: ``args.device_rank``, else ``LOCAL_RANK``).

    ``deepspeed.comm.init_distributed`` binds the world group to ``cuda:LOCAL_RANK`` but
    sets no device, and our group creation communicates before the engine exists: without
    this every rank would stage its NCCL tensors on ``cuda:0``. Nothing happens on other
    accelerators, without a known local rank, or when the device is already that one.
    """
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cuda":
        return
    local = getattr(args, "device_rank", None)
    if local is None:
        env = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"))
        local = int(env) if env is not None else getattr(args, "local_rank", None)
    if local is None or int(local) < 0:
        return
    if acc.current_device() != int(local):
        acc.set_device(int(local))


def _zero_settings(cfg: dict, st: StarTrailConfig) -> None:
    """Check (and for hpz_team, set) the ZeRO keys; ``cfg`` is our copy."""
    zero = cfg.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage == 3 and zero.get("reduce_scatter", True) is False:
        raise NotImplementedError(
            "zero_optimization.reduce_scatter=false with ZeRO-3 and startrail: DeepSpeed 0.19 then "
            "averages some buckets over sequence x data ranks and others over data ranks only; "
            "allowed: reduce_scatter true (the default)"
        )
    if stage == 3 and zero.get("zero_quantized_gradients", False):
        raise NotImplementedError(
            "zero_optimization.zero_quantized_gradients with startrail is not supported; "
            "allowed: false"
        )
    hpz = zero.get("zero_hpz_partition_size", 1)
    if st.zero_mapping == "hpz_team":
        if stage != 3:
            raise ValueError(
                f"startrail.zero_mapping='hpz_team' needs zero_optimization.stage=3 (ZeRO++ hpZ is "
                f"a ZeRO-3 feature), got stage {stage}; allowed with stage {stage}: 'none'"
            )
        if hpz not in (1, st.team_size):
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size={hpz} conflicts with "
                f"startrail.zero_mapping='hpz_team' (which sets it to team_size={st.team_size}); "
                f"allowed: leave it out, 1 or {st.team_size}"
            )
        zero["zero_hpz_partition_size"] = st.team_size
    elif hpz not in (0, 1):
        raise NotImplementedError(
            f"zero_optimization.zero_hpz_partition_size={hpz} with startrail: set "
            "startrail.zero_mapping='hpz_team' instead (hpZ groups must be StarTrail teams)"
        )


def _check_hpz_is_team(mpu: StarTrailMPU) -> None:
    """Assert that DeepSpeed's hpZ group is this rank's StarTrail team."""
    lay, d = mpu.startrail.layout, mpu.data_parallel_rank
    team = [d * lay.cp_size + r for r in lay.team_ranks(lay.coord(mpu.startrail.cp_rank)[0])]
    got = internals.hpz_group_ranks()
    if got != team:
        raise RuntimeError(
            f"DeepSpeed's hpZ partition group {got} is not this rank's StarTrail team {team}"
        )


def _refuse_inactive(st: StarTrailConfig | None, model) -> None:
    """What plain DeepSpeed (the section absent, disabled, or with P = 1) would get wrong,
    silently: settings of an enabled section it would drop, and a megatron-core GPTModel
    whose StarTrail attention spans Megatron's CP ranks (DeepSpeed would take them for
    data-parallel replicas, each rank's full batch for one shard of a longer sequence)."""
    if st is not None and st.enabled:
        dropped = sorted(
            k for k in st.model_fields_set - {"enabled", "sequence_parallel_size"}
            if getattr(st, k) != type(st).model_fields[k].default
        )  # fmt: skip
        if dropped:
            raise ValueError(
                f"startrail.{dropped[0]} is set but startrail.sequence_parallel_size is 1: the "
                "section changes nothing at P = 1, so it would be ignored; set "
                "sequence_parallel_size > 1 or drop " + ", ".join(f"startrail.{k}" for k in dropped)
            )
    from .megatron_gpt import is_megatron_gpt

    if not is_megatron_gpt(model):
        return
    from megatron.core import parallel_state

    from ..megatron.attention import StarTrailCoreAttention

    cp = parallel_state.get_context_parallel_world_size() if (
        parallel_state.model_parallel_is_initialized()
    ) else 1  # fmt: skip
    if cp > 1 and any(isinstance(m, StarTrailCoreAttention) for m in model.modules()):
        raise ValueError(
            f"this GPTModel runs StarTrail attention over Megatron's context_parallel_size={cp}, "
            "but the DeepSpeed config's startrail section is "
            + ("absent or disabled" if st is None or not st.enabled else "at P = 1")
            + f': set "startrail": {{"enabled": true, "sequence_parallel_size": {cp}}}'
        )


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """``deepspeed.initialize`` with StarTrail (see the module docstring).

    Returns DeepSpeed's ``(engine, optimizer, training_dataloader, lr_scheduler)``;
    ``engine.startrail_mpu`` holds the groups (``StarTrailMPU``), ``engine.startrail_handle``
    the model preparation (``HFHandle``; set its ``shard_inputs = False`` to feed batches
    from ``StarTrailDataLoaderAdapter``).
    """
    plain = dict(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        distributed_port=distributed_port,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
        mesh_param=mesh_param,
        config_params=config_params,
    )
    cfg = resolve_config(args, config, config_params)
    st = StarTrailConfig.from_ds_config(cfg) if cfg is not None else None
    if st is None or not st.active:
        _refuse_inactive(st, model)
        return internals.original_initialize(**plain)

    # Checks that need no communication first.
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "startrail creates the sequence-parallel groups itself: pass mpu=None and "
            "mesh_param=None (or disable startrail.enabled)"
        )
    for key in ("sequence_parallel_size", "data_parallel_size"):
        if key in cfg:
            raise ValueError(
                f"top-level {key!r} selects DeepSpeed's own sequence-parallel mesh; with startrail "
                f"set startrail.sequence_parallel_size instead and remove {key!r}"
            )
    autotp = (cfg.get("tensor_parallel") or {}).get("autotp_size", 0)
    if autotp not in (0, 1):
        raise NotImplementedError(
            f"tensor_parallel.autotp_size={autotp} with startrail: DeepSpeed's AutoTP training "
            "(its vocabulary-parallel lm_head and loss included) does not run inside "
            "StarTrail's groups yet; allowed: 0 or 1 (for tensor parallelism with StarTrail use "
            "Megatron's GPT, --tensor-model-parallel-size)"
        )
    if training_data is not None:
        raise NotImplementedError(
            "training_data with startrail: DeepSpeed's loader gives every sequence rank other "
            "samples, but the P ranks of a replica need the same batch; pass training_data=None "
            "and shard your data over engine.startrail_mpu.data_parallel_rank / "
            "data_parallel_size"
        )
    _zero_settings(cfg, st)
    if st.hybrid_context_parallel and int(cfg["zero_optimization"].get("stage", 0)) == 3:
        tiled = [k for k in ("tiled_mlp", "tiled_loss") if getattr(st, k) is not None]
        if tiled:  # ranks of other token counts would make other numbers of gathers
            raise NotImplementedError(
                f"startrail.hybrid_context_parallel with startrail.{tiled[0]} under ZeRO-3: "
                "the ranks hold different numbers of tokens, so the tiles would gather ZeRO-3's "
                "parameters a different number of times per rank; use ZeRO 0 - 2 or drop "
                f"startrail.{tiled[0]}"
            )
    from ..dit.model import DiT
    from .megatron_gpt import is_megatron_gpt

    megatron_model = is_megatron_gpt(model)
    dit_model = isinstance(model, DiT)
    if not (megatron_model or dit_model):
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise NotImplementedError(
                f"startrail in DeepSpeed prepares transformers causal LMs, megatron-core "
                f"GPTModels and startrail_megatron.dit.DiT; got {type(model).__name__}"
            )

    if megatron_model:
        for key, what in (("mtp_num_layers", "multi-token prediction"),
                          ("num_moe_experts", "mixture of experts")):  # fmt: skip
            if getattr(model.config, key, None):
                raise NotImplementedError(
                    f"a megatron-core GPTModel with {key}={getattr(model.config, key)} ({what}) "
                    "through DeepSpeed with startrail: its auxiliary loss is scaled by each "
                    "rank's own tokens and then summed over the sequence ranks, so its "
                    "gradients would be wrong: not supported on the DeepSpeed path"
                )
    if dit_model and st.ulysses_size > 1 and model.cfg.text_tokens:
        raise NotImplementedError(
            f"startrail.ulysses_size={st.ulysses_size} with a DiT of text tokens (MMDiT, "
            f"text_tokens={model.cfg.text_tokens}): joint keys are not supported with the 2-D "
            "split yet; use ulysses_size 1"
        )
    import deepspeed.comm as ds_dist
    from deepspeed.accelerator import get_accelerator

    ds_dist.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    set_local_device(args)  # before our groups' first collectives (NCCL: the right GPU)
    import torch.distributed as dist

    st.check_world(dist.get_world_size())  # identical on every rank: fails before any group
    for key, flag in (
        ("tiled_mlp", "--startrail-tiled-mlp"),
        ("tiled_loss", "--startrail-tiled-loss"),
        ("attention_tile", "--startrail-attention-tile"),
        ("attention_head_chunks", "--startrail-attention-head-chunks"),
    ):
        if getattr(st, key) is not None and (megatron_model or dit_model):
            raise ValueError(
                f"startrail.{key}={getattr(st, key)} is for transformers models; for Megatron's "
                f"GPT use {flag}, the DiT path has no tiling yet: drop the key"
            )
    if st.hybrid_context_parallel and (megatron_model or dit_model):
        raise ValueError(
            "startrail.hybrid_context_parallel is for transformers causal LMs; for Megatron's "
            "GPT use our entry point's --hybrid-context-parallel (docs/megatron.md), the DiT "
            "path has no per-batch layouts (its samples are one length): drop the key"
        )
    if st.tiled_loss is not None and not (megatron_model or dit_model):
        from .tiled_loss import check_hf_loss

        check_hf_loss(model, st.tiled_loss)  # before any group is made
    if megatron_model:
        from .megatron_gpt import megatron_mpu, prepare_megatron_gpt

        st_mpu = megatron_mpu(st)  # Megatron's CP group and its StarTrail groups
        handle = prepare_megatron_gpt(model, st_mpu)
    elif dit_model:
        from ..dit.parallel import parallelize_dit

        st_mpu = StarTrailMPU.create(st)
        handle = parallelize_dit(model, st_mpu.startrail)  # loss: dit.diffusion_loss
    else:
        st_mpu = StarTrailMPU.create(st)
        from .hf import prepare_hf_model

        if st.hybrid_context_parallel:
            from .hybrid import HybridSchedule

            half = any((cfg.get(k) or {}).get("enabled", False) for k in ("bf16", "fp16"))
            schedule = HybridSchedule.for_hf_model(model, st, elem_bytes=2 if half else None)
            st_mpu = dataclasses.replace(st_mpu, batch_schedule=schedule)

        handle = prepare_hf_model(model, st_mpu, tiled_mlp=st.tiled_mlp, tiled_loss=st.tiled_loss)
    stage = int(cfg["zero_optimization"].get("stage", 0))
    handle.grad_scale = float(st.sequence_parallel_size) if stage == 3 else 1.0

    if stage == 3:
        ring_hpz = st.zero_mapping == "hpz_team" and st.placement != "team"
        # team placement: DeepSpeed's contiguous hpZ groups are the teams (checked below);
        # ring placement: teams are strided, so hand DeepSpeed the team groups themselves.
        internals.set_hpz_group(st_mpu.startrail.team_group if ring_hpz else None)

    cfg.pop(STARTRAIL_KEY)
    if args is not None and (
        getattr(args, "deepspeed_config", None) is not None
        or getattr(args, "deepscale_config", None) is not None
    ):
        args = copy.copy(args)
        for name in ("deepspeed_config", "deepscale_config"):
            if hasattr(args, name):
                setattr(args, name, None)
    plain.update(args=args, mpu=st_mpu, config=cfg, config_params=None)
    try:
        engine, opt, loader, sched = internals.original_initialize(**plain)
        if st.zero_mapping == "hpz_team":
            _check_hpz_is_team(st_mpu)
    except BaseException:
        handle.remove()  # leave the model as it was given
        raise
    engine.startrail_mpu = st_mpu
    engine.startrail_handle = handle
    return engine, opt, loader, sched
