"""The DiT trainer's settings and training loop (the command line: ``train.py``).

World = D data-parallel replicas x P StarTrail ranks (global rank = d * P + cp_rank, as
``deepspeed.StarTrailMPU``). Every rank of a replica draws the same batch, timesteps, noise
and label drop from the replica's generator (``data.ReplicaBatches``; checked each step:
``check_replicated``); replicas draw different ones. Each rank's loss is its part of the
replica's mean squared error over real tokens; gradients are summed over the world and
divided by D (plain PyTorch), or reduced by DeepSpeed (``deepspeed_config`` with a
``"startrail"`` section). ``reference_run``: the same training in one process.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import all_reduce_sum
from ..groups import StarTrailGroups
from ..layout import PLACEMENTS
from ..validation import own_rows_first_setting
from .data import ReplicaBatches
from .model import DiT, DiTConfig, patchify
from .parallel import DiTHandle, check_replicated, diffusion_loss, parallelize_dit

__all__ = ["DTYPES", "TrainArgs", "TrainResult", "build_model", "reference_run", "run_training"]

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


def _optimizer(model, args: TrainArgs):
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)


def _forward(model, batch) -> Tensor:
    return model(batch["x"], batch["t"], batch["y"], batch["context"])


def reference_run(args: TrainArgs, replicas: int = 1) -> tuple[list[float], dict[str, Tensor]]:
    """One process, no sequence parallelism: the replicas' batches side by side (their mean
    loss is the mean of the replicas' losses). Losses and final parameters."""
    model = build_model(args)
    opt = _optimizer(model, args)
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


def _groups(args: TrainArgs) -> tuple[StarTrailGroups, int, int]:
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


def run_training(
    args: TrainArgs,
    groups: StarTrailGroups | None = None,
    batches: ReplicaBatches | None = None,
    log=print,
) -> TrainResult:
    """Train on the initialized process group; every rank calls it. With
    ``deepspeed_config`` the groups are the ``"startrail"`` section's (DeepSpeed's mpu);
    else ``groups`` or new ones over ``cp_size`` ranks per replica."""
    dtype = DTYPES[args.dtype]
    device = _device()
    model = build_model(args).to(device)
    if args.deepspeed_config is not None:
        if groups is not None:
            raise ValueError("run_training: with deepspeed_config the groups come from DeepSpeed")
        engine, handle = _deepspeed_engine(model, args)
        handle.sdpa.kernel = args.kernel  # the section gives P, C and placement; --kernel is ours
        step_model, scale = engine, handle.grad_scale
        mpu = engine.startrail_mpu
        replica, replicas = mpu.data_parallel_rank, mpu.data_parallel_size
        if args.cp_size not in (None, mpu.startrail.cp_size):
            raise ValueError(
                f"--cp-size {args.cp_size} differs from the DeepSpeed config's "
                f"startrail.sequence_parallel_size {mpu.startrail.cp_size}: give one of them"
            )
    else:
        if groups is None:
            groups, replica, replicas = _groups(args)
        else:
            replicas = dist.get_world_size() // groups.cp_size
            replica = dist.get_rank() // groups.cp_size
        handle = parallelize_dit(model, groups, kernel=args.kernel)
        engine, step_model, scale = None, model, 1.0
        opt = _optimizer(model, args)
    if batches is None:
        batches = ReplicaBatches(args.model, args.seed, replica, args.micro_batch_size, dtype)
    groups = handle.groups
    tokens, p = handle.tokens, groups.cp_size
    losses, t0, log_rows = [], time.perf_counter(), []
    for it in range(1, args.steps + 1):
        batch = {k: None if v is None else v.to(device) for k, v in batches.next().items()}
        check_replicated(
            groups.cp_group, noise=batch["noise"], timesteps=batch["t"], labels=batch["y"],
            **({} if batch["context"] is None else {"context": batch["context"]}),
        )  # fmt: skip
        pred = _forward(step_model, batch)
        target = tokens.shard(patchify(batch["noise"], args.model.patch_size))
        loss = diffusion_loss(pred, target, tokens, scale)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            _reduce_gradients(model, replicas)
            opt.step()
            opt.zero_grad()
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
            json.dump({"args": _jsonable(args), "log": log_rows, "losses": losses}, f, indent=1)
    el = time.perf_counter() - t0
    tps = args.steps * args.micro_batch_size * replicas * tokens.num_tokens / el
    return TrainResult(losses, model, handle, tps, engine)


def _jsonable(args: TrainArgs) -> dict:
    return asdict(args)


def _device() -> torch.device:
    """This rank's CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_gradients(model: torch.nn.Module, replicas: int) -> None:
    """Sum every gradient over the world (the CP ranks' parts, the replicas) and divide by
    the replicas: the mean over replicas of each replica's whole gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_sum(flat, None, "gradients").div_(replicas)
    at = 0
    for g in grads:
        g.copy_(flat[at : at + g.numel()].view_as(g))
        at += g.numel()


def _deepspeed_engine(model, args: TrainArgs):
    from .. import deepspeed as st_ds

    with open(args.deepspeed_config) as f:
        cfg = json.load(f)
    opt = _optimizer(model, args)
    engine, _, _, _ = st_ds.initialize(model=model, optimizer=opt, config=cfg)
    return engine, engine.startrail_handle
