"""The DiT trainer's settings and training loop (the command line: ``train.py``).

World = D data-parallel replicas x P StarTrail ranks (global rank = d * P + cp_rank, as
``deepspeed.StarTrailMPU``). Every rank of a replica draws the same batch, timesteps, noise
and label drop from the replica's generator (``data.ReplicaBatches``; checked each step:
``check_replicated``); replicas draw different ones. Each rank's loss is its part of the
replica's mean squared error over real tokens; gradients are summed over the world and
divided by D (plain PyTorch), or reduced by DeepSpeed (``deepspeed_config`` with a
``"startrail"`` section; that path lives in ``deepspeed/dit.py``, which hands this loop a
``prepare`` hook: dit/ never imports deepspeed/). ``reference_run``: the same training in
one process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import all_reduce_sum
from ..groups import StarTrailGroups
from ..schedule.layout import PLACEMENTS
from ..validation import own_rows_first_setting
from .data import ReplicaBatches
from .model import DiT, DiTConfig, patchify
from .parallel import DiTHandle, check_replicated, diffusion_loss, parallelize_dit

__all__ = [
    "DTYPES",
    "TrainArgs",
    "TrainResult",
    "TrainSetup",
    "build_model",
    "build_optimizer",
    "create_groups",
    "plain_setup",
    "reduce_gradients",
    "reference_run",
    "run_training",
    "training_device",
]

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class TrainArgs:
    model: DiTConfig = field(default_factory=DiTConfig)
    steps: int = 20
    micro_batch_size: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    seed: int = 0
    team_size: int = 1
    placement: str = "team"
    cp_size: int | None = None  # None: the whole world
    dtype: str = "fp32"
    kernel: str = "auto"
    own_rows_first: str = "auto"  # auto | on | off: StarTrailGroups.own_rows_first
    deepspeed_config: str | None = None
    log_interval: int = 10
    json_log: str | None = None
    randomize_zero_init: bool = False  # tests: adaLN-Zero gives most blocks no gradient

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not supported; allowed: {list(DTYPES)}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer {self.optimizer!r}; allowed: ['adamw', 'sgd']")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement {self.placement!r}; allowed: {list(PLACEMENTS)}")
        orf = own_rows_first_setting(self.own_rows_first, "--own-rows-first")
        if self.deepspeed_config is not None and orf is not None:
            raise ValueError(
                f"--own-rows-first {self.own_rows_first} with --deepspeed-config: give it as the "
                "config's startrail.own_rows_first instead; allowed here: 'auto'"
            )
        if self.deepspeed_config is not None:
            if self.dtype == "fp64":
                raise ValueError(
                    "--dtype fp64 with --deepspeed-config: DeepSpeed keeps fp32 master weights "
                    "(ZeRO 1-3) or cannot reduce float64 gradients (ZeRO 0); allowed: fp32"
                )
        for name in ("steps", "micro_batch_size", "team_size", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )


# ---- the model -------------------------------------------------------------------------
def build_model(args: TrainArgs) -> DiT:
    """The DiT, seeded (the same on every rank); with ``randomize_zero_init`` the adaLN-Zero
    and output layers get small random weights so that every parameter has a gradient."""
    torch.manual_seed(args.seed)
    model = DiT(args.model).to(DTYPES[args.dtype])
    if args.randomize_zero_init:
        g = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for m in model.modules():
                lin = m.adaLN_modulation[-1] if hasattr(m, "adaLN_modulation") else None
                for x in () if lin is None else (lin.weight, lin.bias):
                    x.copy_(0.05 * torch.randn(x.shape, generator=g, dtype=torch.float64))
            for x in (model.final_layer.linear.weight, model.final_layer.linear.bias):
                x.copy_(0.05 * torch.randn(x.shape, generator=g, dtype=torch.float64))
    return model


def build_optimizer(model, args: TrainArgs):
    """``args.optimizer`` (AdamW or SGD) over ``model``'s parameters."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)


def _forward(model, batch) -> Tensor:
    return model(batch["x"], batch["t"], batch["y"], batch["context"])


def reference_run(args: TrainArgs, replicas: int = 1) -> tuple[list[float], dict[str, Tensor]]:
    """One process, no sequence parallelism: the replicas' batches side by side (their mean
    loss is the mean of the replicas' losses). Losses and final parameters."""
    model = build_model(args)
    opt = build_optimizer(model, args)
    streams = [
        ReplicaBatches(args.model, args.seed, d, args.micro_batch_size, DTYPES[args.dtype])
        for d in range(replicas)
    ]
    losses = []
    for _ in range(args.steps):
        bs = [s.next() for s in streams]
        batch = {k: None if bs[0][k] is None else torch.cat([b[k] for b in bs]) for k in bs[0]}
        pred = _forward(model, batch)
        loss = ((pred - patchify(batch["noise"], args.model.patch_size)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


# ---- distributed training --------------------------------------------------------------
@dataclass
class TrainResult:
    losses: list[float]
    model: torch.nn.Module
    handle: DiTHandle
    tokens_per_s: float = 0.0
    engine: object = None  # the DeepSpeed engine, if any


@dataclass
class TrainSetup:
    """What ``run_training`` trains, made by ``plain_setup`` or a ``prepare`` hook (the
    DeepSpeed path: ``deepspeed.dit.deepspeed_setup``).

    ``step_model``: what the batch goes through (the model, or a DeepSpeed engine);
    ``handle``: ``parallelize_dit``'s; ``replica`` of ``replicas``: this rank's data-parallel
    replica; ``grad_scale``: the loss factor (``diffusion_loss``'s ``scale``). A step is
    ``engine.backward(loss); engine.step()`` where ``engine`` is set, else backward, the
    gradients summed over the world and divided by ``replicas``, and ``optimizer``'s step.
    """

    step_model: torch.nn.Module
    handle: DiTHandle
    replica: int
    replicas: int
    grad_scale: float = 1.0
    optimizer: torch.optim.Optimizer | None = None
    engine: object = None


def create_groups(args: TrainArgs) -> tuple[StarTrailGroups, int, int]:
    """(StarTrail groups over this rank's CP group, replica d, replicas D); every rank
    creates every CP group in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    p = args.cp_size or world
    if world % p:
        raise ValueError(f"--cp-size {p} must divide the world size {world}")
    mine = None
    if p != world:
        for d in range(world // p):
            g = dist.new_group(list(range(d * p, (d + 1) * p)))
            if d == rank // p:
                mine = g
    groups = StarTrailGroups.create(
        args.team_size,
        cp_group=mine,
        placement=args.placement,
        own_rows_first=own_rows_first_setting(args.own_rows_first, "--own-rows-first"),
    )
    return groups, rank // p, world // p


def plain_setup(model: DiT, args: TrainArgs, groups: StarTrailGroups | None) -> TrainSetup:
    """Plain PyTorch: ``groups`` (else new ones over ``cp_size`` ranks per replica,
    ``create_groups``), the model parallelized on them, ``args``' optimizer."""
    if groups is None:
        groups, replica, replicas = create_groups(args)
    else:
        replicas = dist.get_world_size() // groups.cp_size
        replica = dist.get_rank() // groups.cp_size
    handle = parallelize_dit(model, groups, kernel=args.kernel)
    return TrainSetup(model, handle, replica, replicas, optimizer=build_optimizer(model, args))


def run_training(
    args: TrainArgs,
    groups: StarTrailGroups | None = None,
    batches: ReplicaBatches | None = None,
    log=print,
    prepare: Callable[[DiT, TrainArgs], TrainSetup] | None = None,
) -> TrainResult:
    """Train on the initialized process group; every rank calls it. ``prepare(model, args)``
    makes the ``TrainSetup`` where given (the DeepSpeed path,
    ``deepspeed.dit.run_training``, which ``deepspeed_config`` needs); else
    ``plain_setup`` with ``groups`` or new ones over ``cp_size`` ranks per replica."""
    if prepare is None and args.deepspeed_config is not None:
        raise ValueError(
            "run_training: deepspeed_config needs the DeepSpeed path: call "
            "startrail_megatron.deepspeed.dit.run_training (python -m "
            "startrail_megatron.dit.train --deepspeed-config picks it)"
        )
    if prepare is not None and groups is not None:
        raise ValueError("run_training: with prepare= the groups come from it; pass groups=None")
    dtype = DTYPES[args.dtype]
    device = training_device()
    model = build_model(args).to(device)
    setup = plain_setup(model, args, groups) if prepare is None else prepare(model, args)
    handle, replicas, scale, engine = setup.handle, setup.replicas, setup.grad_scale, setup.engine
    if batches is None:
        batches = ReplicaBatches(args.model, args.seed, setup.replica, args.micro_batch_size, dtype)
    groups = handle.groups
    tokens, p = handle.tokens, groups.cp_size
    losses, t0, log_rows = [], time.perf_counter(), []
    for it in range(1, args.steps + 1):
        batch = {k: None if v is None else v.to(device) for k, v in batches.next().items()}
        # the noise (the model's own inputs are checked in its forward: parallelize_dit)
        check_replicated(groups.cp_group, noise=batch["noise"])
        pred = _forward(setup.step_model, batch)
        target = tokens.shard(patchify(batch["noise"], args.model.patch_size))
        loss = diffusion_loss(pred, target, tokens, scale)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            reduce_gradients(model, replicas)
            setup.optimizer.step()
            setup.optimizer.zero_grad()
        part = (loss.detach() / scale).to(torch.float64).reshape(1)
        mse = all_reduce_sum(part, None, "loss").item() / replicas  # replicas' mean MSE
        losses.append(mse)
        if it % args.log_interval == 0 or it == args.steps:
            el = time.perf_counter() - t0
            tps = it * args.micro_batch_size * replicas * tokens.num_tokens / el
            row = {"iteration": it, "loss": mse, "tokens_per_s": tps, "elapsed_s": el}
            log_rows.append(row)
            if dist.get_rank() == 0:
                log(
                    f"iteration {it}/{args.steps} | loss {mse:.6f} | {tps:,.0f} tokens/s | "
                    f"{el:.1f} s | P = {p}, C = {groups.layout.team_size}, "
                    f"{tokens.num_tokens} tokens ({tokens.s_local} per rank"
                    f"{', padded' if tokens.padded else ''})"
                )
    if args.json_log and dist.get_rank() == 0:
        with open(args.json_log, "w") as f:
            json.dump({"args": asdict(args), "log": log_rows, "losses": losses}, f, indent=1)
    el = time.perf_counter() - t0
    tps = args.steps * args.micro_batch_size * replicas * tokens.num_tokens / el
    return TrainResult(losses, model, handle, tps, engine)


def training_device() -> torch.device:
    """This rank's CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_gradients(model: torch.nn.Module, replicas: int) -> None:
    """Sum every gradient over the world (the CP ranks' parts, the replicas) and divide by
    the replicas: the mean over replicas of each replica's whole gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_sum(flat, None, "gradients").div_(replicas)
    at = 0
    for g in grads:
        g.copy_(flat[at : at + g.numel()].view_as(g))
        at += g.numel()
