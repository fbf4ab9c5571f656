"""GPT pre-training with megatron-core and StarTrail: the process around ``training.train``.

    python -m startrail_megatron.pretrain_gpt --nproc 4 --context-parallel-size 4 \\
        --context-parallel-impl startrail --startrail-team-size 2 --mock-data ...

(``python -m startrail_megatron.megatron.pretrain_gpt`` is the same.) ``main``
parses the flags, then either spawns ``--nproc`` gloo ranks on this machine or,
under ``torchrun``, joins the process group (NCCL on GPUs, with each rank's
device set from ``LOCAL_RANK``), runs ``training.train`` and destroys the
process group. Importing this module filters megatron-core's warnings that
Apex / Transformer Engine are absent (expected on CPU ranks, repeated once per
rank); importing ``startrail_megatron.megatron`` imports no megatron-core, so
the filters come first.
"""

import warnings

warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
)
warnings.filterwarnings("ignore", message=r".*full scope is deprecated")

import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ..spawn import spawn_local_ranks  # noqa: E402
from .training import parse_args, train  # noqa: E402

__all__ = ["main"]


def _train_rank(rank: int, world: int, args) -> None:
    train(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.nproc:
        _banner(args)
        spawn_local_ranks(
            _train_rank,
            args.nproc,
            args,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
            ranks_handle_sigint=True,
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
    if impl == "startrail" and args.hybrid_context_parallel and args.startrail_team_size == "auto":
        from .training.hybrid import model_team_sizes  # what initialize gives each size

        extra += f" (per sub-group size, the cost model's: {model_team_sizes(args)})"
    orf = getattr(args, "startrail_own_rows_first", "auto")
    if impl == "startrail" and orf != "auto":
        extra += f", own rows first {orf}"
    print(
        f"GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads "
        f"({args.num_query_groups} query groups), seq {args.seq_length}; TP {args.tensor_model_parallel_size}"
        f" x CP {args.context_parallel_size} ({impl}{extra}) x DP {args.data_parallel_size}; "
        f"global batch {args.global_batch_size}",
        flush=True,
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
