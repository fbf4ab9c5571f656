"""The entry point's command line: Megatron-LM's flag names for what it supports.

``parse_args(argv)`` builds the parser (``build_parser``: model, parallelism,
training flags, the checkpoint flags from ``checkpoint.py``, StarTrail's flags from
``megatron/arguments.py``), parses and validates (``validate_args``: a bad flag exits
with argparse's error naming it) and derives what Megatron-LM derives (``num_query_groups``,
``max_position_embeddings``, ``data_parallel_size``, ``global_batch_size``).
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from .. import versions
from ..arguments import add_startrail_args, validate_startrail_args
from . import flags
from .checkpoint import add_checkpoint_args
from .hybrid import add_hybrid_args, check_hybrid_args
from .recompute import add_recompute_args, validate_recompute

__all__ = ["build_parser", "parse_args", "validate_args"]


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
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer: ids 0..V-1, plus the end-of-document id V (mock data: 127)",
    )
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument(
        "--window-size",
        type=_window_size,
        default=None,
        help="sliding window (left,right) as Megatron-LM takes it, e.g. 255,0 (-1: unbounded)",
    )
    g.add_argument(
        "--window-attn-skip-freq",
        type=_layer_pattern,
        default=None,
        help="N: every N-th layer full attention; or a list expression of 1 (window) / 0 per "
        "layer, e.g. '([1]*3+[0])*2' (Megatron-LM's)",
    )
    g.add_argument(
        "--softmax-type",
        choices=["vanilla", "off-by-one", "learnable"],
        default="vanilla",
        help="attention sinks: off-by-one (a zero logit) or learnable (one per head)",
    )
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument(
        "--init-method-std", type=float, default=0.02, help="std of the weights' normal init"
    )
    g.add_argument("--bf16", action="store_true")
    add_recompute_args(p)
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
    g = p.add_argument_group("learning-rate and weight-decay schedule (megatron-core's scheduler)")
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default="linear",
    )
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="of --lr-decay-iters")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-wsd-decay-style",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        default="exponential",
    )
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument(
        "--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant"
    )
    g = p.add_argument_group("data and tokenizer (megatron-core's GPT dataset)")
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="megatron-core's MockGPTDataset (the default without --data-path)",
    )
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="prefixes of .bin/.idx files (startrail-preprocess-data), optionally weighted: "
        "'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...'",
    )
    g.add_argument(
        "--split", type=str, default=None, help="train,valid,test proportions (e.g. 949,50,1)"
    )
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument(
        "--tokenizer-type",
        type=str,
        default=None,
        help="NullTokenizer (ids as text, --vocab-size) or HuggingFaceTokenizer (--tokenizer-model DIR)",
    )
    g.add_argument("--tokenizer-model", type=str, default=None, help="a local tokenizer directory")
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the embedding table to a multiple of this (x TP size)",
    )
    g = p.add_argument_group("evaluation, exit and logging")
    g.add_argument("--eval-interval", type=int, default=None, help="evaluate every N iterations")
    g.add_argument("--eval-iters", type=int, default=100, help="validation batches per evaluation")
    g.add_argument("--exit-interval", type=int, default=None, help="stop after iteration N")
    g.add_argument(
        "--exit-duration-in-mins", type=float, default=None, help="stop after this wall time"
    )
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument(
        "--megatron-lm-flags",
        action=_FlagTable,
        nargs=0,
        help="print which Megatron-LM flags are honoured, ignored or refused, and exit",
    )
    g.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="position ids restart after each end-of-document token",
    )
    g.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="attention stays inside each document (ended by the end-of-document token): "
        "StarTrail's packed documents (needs --context-parallel-impl startrail)",
    )
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="the loss is always the mean over the global batch's unmasked tokens here "
        "(this flag's meaning in Megatron-LM)",
    )
    g.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="megatron-core's fused vocab-parallel cross-entropy (its logits gradient is "
        "rounded to bf16, as megatron-core's 'native' implementation does)",
    )
    g.add_argument(
        "--cross-entropy-fusion-impl",
        choices=["native", "te"],
        default="native",
        help="with --cross-entropy-loss-fusion: 'native' (megatron-core's) or 'te' "
        "(Transformer Engine's; needs it installed)",
    )
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument(
        "--log-peak-memory",
        nargs="?",
        const="auto",
        default=None,
        choices=["auto", "live", "rss", "cuda"],
        help="log each iteration's peak memory, the largest rank's: every live tensor (CPU "
        "default 'live'), the resident set's high-water mark "
        "('rss'), or the CUDA allocator's peak (GPU default)",
    )
    g.add_argument("--log-json", type=str, default=None, help="write per-iteration figures here")
    g.add_argument(
        "--startrail-autotune-iters",
        type=int,
        default=3,
        help="timed iterations per candidate for --startrail-team-size auto (after 1 warm-up)",
    )
    add_checkpoint_args(p)
    add_hybrid_args(p)
    add_startrail_args(p)
    flags.add_megatron_lm_flags(p)
    return p


class _FlagTable(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(flags.table(parser))
        parser.exit()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; a bad flag exits with argparse's error naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def validate_args(args: argparse.Namespace, warn=None) -> None:
    flags.check_megatron_lm_flags(args, warn)
    _validate_data_and_schedule(args)
    for name in ("micro_batch_size", "log_interval", "train_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_query_groups is None:  # Megatron-LM: --group-query-attention alone is MQA
        args.num_query_groups = 1 if args.group_query_attention else args.num_attention_heads
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
    if args.max_position_embeddings < args.seq_length:
        raise ValueError(
            f"--max-position-embeddings {args.max_position_embeddings} must be >= --seq-length "
            f"{args.seq_length}"
        )
    if args.swiglu and args.ffn_hidden_size is None:  # Megatron-LM's SwiGLU size
        args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    validate_recompute(args)
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        if not versions.have_transformer_engine():
            raise ValueError(
                "--cross-entropy-fusion-impl te needs Transformer Engine; allowed here: native"
            )
    if args.ckpt_step is not None and not args.load:
        raise ValueError("--ckpt-step needs --load")
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1 and args.context_parallel_impl == "te" and not versions.have_transformer_engine():
        raise ValueError(
            "--context-parallel-impl te needs Transformer Engine, which is not installed; "
            "use --context-parallel-impl startrail"
        )
    if args.reset_attention_mask and args.context_parallel_impl != "startrail":
        raise ValueError(
            "--reset-attention-mask needs --context-parallel-impl startrail (also at "
            "--context-parallel-size 1): Megatron's own attention here ignores document "
            "boundaries"
        )
    validate_startrail_args(args)

    if args.seq_length % (2 * cp) and cp > 1 and not args.reset_attention_mask:
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
    check_hybrid_args(args)


def _window_size(x: str) -> tuple[int, int]:
    """Megatron-LM's ``--window-size`` (``tuple_type``): "255,0" or "(255,0)"."""
    try:
        out = tuple(int(i) for i in x.strip("()").split(","))
    except ValueError:
        out = ()
    if len(out) != 2 or min(out) < -1:
        raise argparse.ArgumentTypeError(
            f"{x!r}: give left,right as integers >= -1 (-1: unbounded), e.g. 255,0"
        )
    return out


def _layer_pattern(x: str):
    """Megatron-LM's ``--window-attn-skip-freq`` (``moe_freq_type``): an int, or a list
    expression of 0/1 such as "([1]*3+[0])*2" (only lists, ints, + and * are allowed)."""
    x = x.strip()
    if "[" not in x:
        try:
            return int(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{x!r}: an integer or a list expression") from None
    import ast

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(ast.dump(node))

    try:
        out = ev(ast.parse(x, mode="eval"))
    except (SyntaxError, ValueError):
        out = None
    if not isinstance(out, list) or any(v not in (0, 1) for v in out):
        raise argparse.ArgumentTypeError(f"{x!r}: a list expression of 0 and 1, one per layer")
    return out


def _validate_data_and_schedule(args: argparse.Namespace) -> None:
    """Megatron-LM's checks and defaults for the data, tokenizer, schedule and evaluation."""
    if args.data_path is not None and args.mock_data:
        raise ValueError("--data-path and --mock-data: give one of them")
    if args.data_path is not None and not args.data_path:
        raise ValueError("--data-path needs at least one prefix")
    if args.data_path is None:
        args.mock_data = True
    tok = args.tokenizer_type
    if tok is None:
        tok = args.tokenizer_type = "NullTokenizer" if args.mock_data else None
    if tok is None:
        raise ValueError(
            "--data-path needs --tokenizer-type (NullTokenizer or HuggingFaceTokenizer), the "
            "one the data was preprocessed with"
        )
    if tok not in ("NullTokenizer", "HuggingFaceTokenizer"):
        raise ValueError(
            f"--tokenizer-type {tok} is refused here: allowed NullTokenizer, "
            "HuggingFaceTokenizer (a local directory in --tokenizer-model)"
        )
    if tok == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
    if tok == "NullTokenizer":
        if args.vocab_size is None:
            if not args.mock_data:
                raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
            args.vocab_size = 127  # 128 ids with the end-of-document token
    elif args.vocab_size is not None:
        raise ValueError("--vocab-size is for NullTokenizer; the HF tokenizer has its own")
    if args.split is None:  # Megatron-LM's legacy default; mock data: all for training
        args.split = "969, 30, 1" if not args.mock_data else "1, 0, 0"
    from .tokenizer import build_tokenizer

    tok = build_tokenizer(args)  # sets padded_vocab_size; a bad --tokenizer-model fails here
    args.eod_id = tok.eod
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ValueError("--lr-warmup-fraction and --lr-warmup-iters: give one of them")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    warm = (
        args.lr_warmup_fraction * args.lr_decay_iters
        if args.lr_warmup_fraction is not None
        else args.lr_warmup_iters
    )
    if args.lr_decay_iters < 1 or warm >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-decay-iters {args.lr_decay_iters} must be >= 1 and exceed the warm-up "
            f"({warm:g} iterations: --lr-warmup-iters / --lr-warmup-fraction)"
        )
    if not 0 <= args.min_lr <= args.lr or args.lr_warmup_init > args.lr:
        raise ValueError(
            f"--min-lr {args.min_lr} and --lr-warmup-init {args.lr_warmup_init} must be in "
            f"[0, --lr {args.lr}]"
        )
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    for name in ("start_weight_decay", "end_weight_decay"):
        if getattr(args, name) is None:
            setattr(args, name, args.weight_decay)
    if (
        args.weight_decay_incr_style == "constant"
        and args.start_weight_decay != args.end_weight_decay
    ):
        raise ValueError(
            "--start-weight-decay and --end-weight-decay differ: give --weight-decay-incr-style "
            "linear or cosine"
        )
    if args.eval_interval is not None and args.eval_interval < 1:
        raise ValueError(f"--eval-interval {args.eval_interval} must be >= 1")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters {args.eval_iters} must be >= 0")
    if args.tensorboard_dir is not None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError(
                "--tensorboard-dir needs the tensorboard package (pip install tensorboard); "
                "or write the curves with --log-json FILE"
            ) from None
