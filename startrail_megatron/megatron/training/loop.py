"""A small GPT pre-training loop on megatron-core's own parts.

Megatron-LM's ``pretrain_gpt.py`` and ``megatron.training`` are not on the
package registry, so this module gives our users a runnable equivalent:
``python -m startrail_megatron.pretrain_gpt`` accepts Megatron-LM's flag names
for what it supports, builds ``GPTModel`` (local spec; the Transformer Engine
spec when TE is installed on GPUs), mock data from megatron-core's
``MockGPTDataset``, megatron-core's ``DistributedDataParallel``, shards each
batch with ``get_batch_on_this_cp_rank``, and trains. With
``--context-parallel-impl startrail`` the layer spec's core attention is
StarTrail's. Each iteration logs the loss, tokens/s and StarTrail's bytes.

Loss and gradients: each rank's loss is its token-loss sum times the DP x CP
size over the global token count; megatron's DDP averages gradients over
DP x CP, so the gradient is that of the global per-token mean, whatever the
CP size or implementation (tests compare CP = 4 with CP = 1).

Optimizer: megatron-core's optimizer wrapper allocates on CUDA, so on CPU
ranks the loop uses ``torch.optim.AdamW`` (or SGD) on megatron DDP's
``main_grad``, with megatron's global-norm clipping (``clip_grad_norm``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..arguments import add_startrail_args, install_from_args, validate_startrail_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m startrail_megatron.pretrain_gpt",
        description="GPT pre-training with megatron-core, optionally with StarTrail context parallelism.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model (Megatron-LM flag names)")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument(
        "--position-embedding-type", choices=["rope", "learned_absolute"], default="rope"
    )
    g.add_argument(
        "--vocab-size", type=int, default=128, help="NullTokenizer vocabulary (mock data)"
    )
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--bf16", action="store_true")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="spawn this many local ranks (CPU/gloo) instead of launching with torchrun",
    )
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this (0: off), as Megatron-LM",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="megatron-core's MockGPTDataset (the only data source here)",
    )
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--log-json", type=str, default=None, help="write per-iteration figures here")
    g.add_argument(
        "--startrail-autotune-iters",
        type=int,
        default=3,
        help="timed iterations per candidate for --startrail-team-size auto (after 1 warm-up)",
    )
    add_startrail_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; a bad flag exits with argparse's error naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def validate_args(args: argparse.Namespace) -> None:
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    elif not args.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention")
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} must be a multiple of "
            f"--num-query-groups {args.num_query_groups}"
        )
    if args.pipeline_model_parallel_size != 1:
        raise ValueError("--pipeline-model-parallel-size: only 1 is supported by this entry point")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1 and args.context_parallel_impl == "te" and not _have_te():
        raise ValueError(
            "--context-parallel-impl te needs Transformer Engine, which is not installed; "
            "use --context-parallel-impl startrail"
        )
    validate_startrail_args(args)
    if args.seq_length % (2 * cp) and cp > 1:
        raise ValueError(
            f"--seq-length {args.seq_length} must be divisible by 2 * --context-parallel-size = {2 * cp}"
        )
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * cp):
        raise ValueError(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--context-parallel-size {cp}"
        )
    args.data_parallel_size = world // (tp * cp)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of "
            f"--micro-batch-size x data-parallel size = {per_step}"
        )


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


# ---- set-up ---------------------------------------------------------------------------


def initialize(args: argparse.Namespace) -> None:
    """Megatron's parallel state (plus StarTrail's groups when enabled) and seeds."""
    from megatron.core import parallel_state

    from ..cpu_support import cpu_manual_seed, enable_cpu_support

    on_cpu = enable_cpu_support()
    install_from_args(args)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    if on_cpu:
        cpu_manual_seed(args.seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)


def teardown() -> None:
    from megatron.core import parallel_state

    from ..hooks import uninstall

    parallel_state.destroy_model_parallel()
    uninstall()


def transformer_config(args: argparse.Namespace):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
    )


def layer_spec(args: argparse.Namespace):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from ..spec import apply_startrail_spec

    if _have_te():  # megatron-core 0.16's TE spec takes no normalization: TENorm reads the config
        spec = _call_supported(
            get_gpt_layer_with_transformer_engine_spec, normalization=args.normalization
        )
    else:
        spec = _call_supported(get_gpt_layer_local_spec, normalization=args.normalization)
    return apply_startrail_spec(spec) if args.context_parallel_impl == "startrail" else spec


def _call_supported(fn, **kwargs):
    """``fn(**kwargs)`` with only the keywords ``fn``'s signature has (they vary by release)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def build_model(args: argparse.Namespace):
    """GPTModel wrapped in megatron-core's DDP (gradients averaged over DP x CP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    if torch.cuda.is_available():
        model.cuda()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(args: argparse.Namespace, model):
    if torch.cuda.is_available():
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum,
            bf16=args.bf16,
            clip_grad=args.clip_grad,
        )
        return get_megatron_optimizer(cfg, [model])
    if args.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(),
            lr=args.lr,
            momentum=args.sgd_momentum,
            weight_decay=args.weight_decay,
        )
    return torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
    )


def build_dataset(args: argparse.Namespace, num_samples: int):
    import logging

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)  # "Unable to save indexes"
    tok = NullTokenizer(args.vocab_size - 1)  # its eod is the last id
    cfg = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split="1,0,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [num_samples, None, None], lambda: True, cfg
    ).build()
    return train


def global_batches(args: argparse.Namespace, dataset):
    """Yield, per iteration, this DP rank's micro-batches of the global batch (full sequence)."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    per_dp = gbs // args.data_parallel_size
    it = 0
    while True:
        base = it * gbs + dp_rank * per_dp
        samples = [dataset[base + i] for i in range(per_dp)]
        micro = []
        for m in range(0, per_dp, mbs):
            chunk = samples[m : m + mbs]
            micro.append({k: torch.stack([s[k] for s in chunk]) for k in chunk[0]})
        yield micro
        it += 1


# ---- the step ----------------------------------------------------------------------


def forward_backward(args: argparse.Namespace, model, micro_batches) -> float:
    """Loss of the global batch (per-token mean); gradients left in ``main_grad``."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    dev = _device()  # also of every reduced tensor: NCCL groups take CUDA tensors only
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    n_dp_cp = dist.get_world_size(dp_cp)
    total_tokens = torch.tensor(
        [sum(float(mb["loss_mask"].sum()) for mb in micro_batches)],
        dtype=torch.float64,
        device=dev,
    )
    dist.all_reduce(total_tokens, group=parallel_state.get_data_parallel_group())
    total = total_tokens.item()
    loss_sum = torch.zeros(1, dtype=torch.float64, device=dev)
    for mb in micro_batches:
        batch = {k: mb[k].to(dev) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        batch = get_batch_on_this_cp_rank(batch)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        local = (losses.float() * batch["loss_mask"]).sum()
        (local * n_dp_cp / total).backward()
        loss_sum += local.detach().double()
    model.finish_grad_sync()
    dist.all_reduce(loss_sum, group=dp_cp)
    return loss_sum.item() / total


def clip_grad_norm(model, max_norm: float) -> float:
    """Megatron's global gradient-norm clipping on ``.grad``, for the CPU optimizer path.

    The norm counts each parameter once over the tensor-parallel group (TP shards
    summed, TP-replicated parameters once), as ``clip_grad_by_total_norm_fp32``;
    clipped when ``max_norm / (norm + 1e-6) < 1``. Returns the norm before clipping.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
    for p in model.parameters():
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            sq += p.grad.double().pow(2).sum()
    dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    norm = sq.sqrt().item()
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def optimizer_step(model, optimizer, clip_grad: float = 0.0) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        for p in model.parameters():
            p.grad = p.main_grad.to(p.dtype) if p.main_grad.dtype != p.dtype else p.main_grad
        if clip_grad > 0:
            clip_grad_norm(model, clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()  # megatron's optimizer clips by its config
        optimizer.zero_grad()
    model.zero_grad_buffer()


def _device() -> torch.device:
    """The device of this rank's tensors (and of what it reduces): its GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def autotune_team_size(args: argparse.Namespace, model, log=print) -> list[str]:
    """``--startrail-team-size auto``: time each valid (C, placement), keep the fastest.

    The paper's scheduler (sec. 4.4): every candidate runs a warm-up and
    ``--startrail-autotune-iters`` forward-backward passes of the first batch
    (gradients discarded, weights untouched); times are reduced with MAX over
    all ranks so every rank picks the same. Sets ``args.startrail_team_size`` and
    ``args.startrail_placement`` and leaves the chosen groups installed.
    """
    from megatron.core import parallel_state

    from ...planner.autotune import autotune, startrail_candidates
    from ..registry import create_startrail_groups, release_startrail_groups

    cp_group = parallel_state.get_context_parallel_group()
    sample = next(global_batches(args, build_dataset(args, args.global_batch_size)))
    lines: list[str] = []

    def say(msg: str) -> None:
        lines.append(msg)
        if log is not None and dist.get_rank() == 0:
            log(msg)

    def run_trial(cand) -> list[float]:
        release_startrail_groups(cp_group)  # the previous candidate's communicators
        create_startrail_groups(cp_group, cand.team_size, cand.placement)
        times = []
        for i in range(args.startrail_autotune_iters + 1):
            t0 = time.perf_counter()
            forward_backward(args, model, sample)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=_device())
            model.zero_grad_buffer()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:
                times.append(t.item())
        return times

    # catch=(): a failure on one rank must not let the ranks choose differently.
    result = autotune(
        startrail_candidates(args.context_parallel_size), run_trial, log=say, catch=()
    )
    best = result.best
    release_startrail_groups(cp_group)
    create_startrail_groups(cp_group, best.team_size, best.placement)
    args.startrail_team_size, args.startrail_placement = best.team_size, best.placement
    return lines


# ---- checkpoints -------------------------------------------------------------------


def _optimizer_file(ckpt: str) -> str:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    return os.path.join(
        ckpt, f"optimizer_tp{parallel_state.get_tensor_model_parallel_rank()}_of{tp}.pt"
    )


def save_checkpoint(path: str, model, iteration: int, optimizer=None) -> None:
    """Megatron distributed checkpoint of the model (the same format for any CP impl/size),
    plus the optimizer state of each TP rank (identical over CP and DP ranks: no
    distributed optimizer), so a resumed run continues exactly."""
    from megatron.core import dist_checkpointing, parallel_state

    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.module.sharded_state_dict(), ckpt)
    if (
        optimizer is not None
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    ):
        torch.save(optimizer.state_dict(), _optimizer_file(ckpt))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def load_checkpoint(path: str, model, optimizer=None) -> int:
    """Load the latest checkpoint; the optimizer state too when it was saved with the same
    tensor-parallel size (any CP implementation, CP or DP size). Returns its iteration."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    ckpt = os.path.join(path, f"iter_{iteration:07d}")
    state = dist_checkpointing.load(model.module.sharded_state_dict(), ckpt)
    model.module.load_state_dict(state)
    if optimizer is not None:
        opt_file = _optimizer_file(ckpt)
        if os.path.exists(opt_file):
            optimizer.load_state_dict(torch.load(opt_file, weights_only=False))
        elif dist.get_rank() == 0:
            print(
                f"note: {ckpt} has no optimizer state for this tensor-parallel size; "
                "the optimizer starts fresh",
                flush=True,
            )
    return iteration


# ---- the loop ------------------------------------------------------------------------


def _startrail_bytes(args) -> dict:
    """StarTrail's bytes in the last iteration, summed over the CP group, and ring's.

    Measured from the ledger; ring attention's figure is the layout's prediction for
    C = 1 at the same shapes (the tests check predictions against ledgers).
    """
    from megatron.core import parallel_state

    from ...layout import StarTrailLayout
    from ..registry import get_startrail_state

    cp_group = parallel_state.get_context_parallel_group()
    state = get_startrail_state(cp_group)
    led, lay = state.ledger, state.groups.layout
    ring = StarTrailLayout(lay.cp_size, 1).comm_bytes(
        state.groups.cp_rank,
        s_local=args.seq_length // lay.cp_size,
        batch=args.micro_batch_size,
        heads_q=args.num_attention_heads // args.tensor_model_parallel_size,
        heads_kv=max(args.num_query_groups // args.tensor_model_parallel_size, 1),
        head_dim=args.hidden_size // args.num_attention_heads,
        elem_bytes=2 if args.bf16 else 4,
    )
    n_calls = (
        args.num_layers
        * args.global_batch_size
        // (args.micro_batch_size * args.data_parallel_size)
    )
    figures = torch.tensor(
        [led.bytes("p2p"), led.bytes("collective"), (ring["fwd_p2p"] + ring["bwd_p2p"]) * n_calls],
        dtype=torch.float64,
        device=_device(),
    )
    led.clear()
    dist.all_reduce(figures, group=cp_group)
    return {
        "p2p": figures[0].item(),
        "collective": figures[1].item(),
        "ring_p2p": figures[2].item(),
    }


def train(args: argparse.Namespace) -> list[dict]:
    """Run the training loop on an initialized process group; returns the log."""
    initialize(args)
    rank = dist.get_rank()
    try:
        model = build_model(args)
        optimizer = build_optimizer(args, model)
        if args.context_parallel_impl == "startrail" and args.startrail_team_size == "auto":
            autotune_team_size(args, model)
        start = 0
        if args.load:
            start = load_checkpoint(args.load, model, optimizer)
        dataset = build_dataset(args, (args.train_iters + 1) * args.global_batch_size)
        batches = global_batches(args, dataset)
        for _ in range(start):
            next(batches)
        log = []
        for it in range(start + 1, args.train_iters + 1):
            t0 = time.perf_counter()
            loss = forward_backward(args, model, next(batches))
            optimizer_step(model, optimizer, args.clip_grad)
            dt = time.perf_counter() - t0
            entry = {
                "iteration": it,
                "loss": loss,
                "seconds": dt,
                "tokens_per_s": args.global_batch_size * args.seq_length / dt,
            }
            if args.context_parallel_impl == "startrail":
                entry["startrail"] = _startrail_bytes(args)
            log.append(entry)
            if rank == 0 and (it % args.log_interval == 0 or it == args.train_iters):
                _print_iteration(args, entry)
            if args.save and args.save_interval and it % args.save_interval == 0:
                save_checkpoint(args.save, model, it, optimizer)
        if args.save and (not args.save_interval or args.train_iters % args.save_interval):
            save_checkpoint(args.save, model, args.train_iters, optimizer)
        if rank == 0 and args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(log, f, indent=1)
        return log
    finally:
        teardown()


def _print_iteration(args, e: dict) -> None:
    width = len(str(args.train_iters))
    line = (
        f" iteration {e['iteration']:>{width}}/{args.train_iters} | lm loss {e['loss']:.6f} | "
        f"{e['seconds'] * 1000:7.1f} ms | {e['tokens_per_s']:8.0f} tokens/s"
    )
    st = e.get("startrail")
    if st:
        saved = 1 - st["p2p"] / st["ring_p2p"] if st["ring_p2p"] else 0.0
        line += (
            f" | StarTrail P2P {st['p2p'] / 1e6:.2f} MB vs ring {st['ring_p2p'] / 1e6:.2f} MB "
            f"({saved:.0%} less), collectives {st['collective'] / 1e6:.2f} MB (CP group)"
        )
    print(line, flush=True)


def _train_rank(rank: int, world: int, args) -> None:
    train(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.nproc:
        from ...spawn import spawn_local_ranks

        _banner(args)
        spawn_local_ranks(
            _train_rank,
            args.nproc,
            args,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
        return
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(minutes=args.distributed_timeout_minutes))
    if dist.get_rank() == 0:
        _banner(args)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def _banner(args) -> None:
    impl = args.context_parallel_impl
    extra = (
        f", StarTrail team size {args.startrail_team_size}, placement {args.startrail_placement}"
        if impl == "startrail"
        else ""
    )
    print(
        f"GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads "
        f"({args.num_query_groups} query groups), seq {args.seq_length}; TP {args.tensor_model_parallel_size}"
        f" x CP {args.context_parallel_size} ({impl}{extra}) x DP {args.data_parallel_size}; "
        f"global batch {args.global_batch_size}",
        flush=True,
    )
    sys.stdout.flush()
