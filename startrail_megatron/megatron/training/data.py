"""Data: megatron-core's GPT datasets (``--data-path`` with ``--split``, or ``--mock-data``)
and the global batches of each iteration.

Sizes as Megatron-LM asks them of its builder (they enter the index cache and the epoch
count, so the same seed gives Megatron-LM's samples): train ``train_iters x global batch``,
validation ``eval_iters x (train_iters // eval_interval + 1) x global batch``, test
``eval_iters x global batch`` (evaluated once, after training, as Megatron-LM does), the
last two with ``--eval-interval`` only; a test part of ``--split`` that holds no document
of a prefix is not asked for (rank 0 says so). Every DP
rank reads its contiguous share of each global batch; the P ranks of a CP group read the
same and shard it in the step (zigzag, or per document with ``--reset-attention-mask``).
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["build_dataset", "build_datasets", "eod_id", "global_batches"]


def eod_id(args: argparse.Namespace) -> int:
    """The end-of-document token of the tokenizer in use."""
    return args.eod_id


def _num_samples(args: argparse.Namespace) -> list[int]:
    gbs = args.global_batch_size
    train = args.train_iters * gbs
    evals = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    valid = args.eval_iters * evals * gbs
    test = args.eval_iters * gbs if args.eval_interval else 0
    # None: not asked for (megatron-core then builds no samples for that split; 0 would
    # loop forever in GPTDataset._get_num_epochs on a split without tokens)
    return [train, valid or None, test or None]


def build_dataset(args: argparse.Namespace, num_samples: int):
    """The training split alone, with ``num_samples`` samples (tests, autotuning)."""
    return _build(args, [num_samples, None, None])[0]


def _without_empty_test(args, cfg, sizes: list) -> list:
    """``sizes`` without the test split where ``--split`` leaves it no document of a prefix
    (megatron-core would loop forever on it): rank 0 says the test evaluation is skipped."""
    if sizes[2] is None or cfg.blend[1] is not None:
        return sizes  # a weighted blend asks for every part: _check_splits names an empty one
    empty = _empty_parts(cfg, 2)
    if not empty:
        return sizes
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"note: --split {args.split!r} leaves the test part of {empty} "
            "empty: no test evaluation after training",
            flush=True,
        )
    return [*sizes[:2], None]


def build_datasets(args: argparse.Namespace):
    """(train, valid or None, test or None): megatron-core's ``GPTDataset`` over
    ``--data-path`` (blend of weighted prefixes, ``--split``, index cache in
    ``--data-cache-path``), or its ``MockGPTDataset``, sized as Megatron-LM sizes them."""
    return _build(args, _num_samples(args))


def _build(args: argparse.Namespace, sizes: list[int]):
    import logging

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    from .tokenizer import build_tokenizer

    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)  # "Unable to save indexes"
    tok = build_tokenizer(args)
    cfg = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tok,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=False,  # documents go to the attention as PackedSeqParams
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
    )
    kind = MockGPTDataset if args.mock_data else GPTDataset
    if not args.mock_data:
        sizes = _without_empty_test(args, cfg, sizes)
        if cfg.blend[1] is not None:  # megatron-core needs a size for every split of a blend
            sizes = [0 if n is None else n for n in sizes]
        _check_splits(cfg, sizes)
    train, valid, test = BlendedMegatronDatasetBuilder(kind, sizes, lambda: True, cfg).build()
    if train is None:
        raise ValueError(f"--split {args.split!r} leaves no training data")
    if sizes[1] and valid is None:
        raise ValueError(
            f"--eval-interval / --eval-iters ask for validation, but --split {args.split!r} "
            "leaves no validation data"
        )
    return train, (valid if sizes[1] else None), (test if sizes[2] else None)


def _check_splits(cfg, sizes: list) -> None:
    """Refuse a split part that is asked for but holds no document of a prefix: megatron-core's
    ``GPTDataset`` would loop forever looking for its tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    names = ("training", "validation", "test")
    for i in range(3):
        empty = _empty_parts(cfg, i) if sizes[i] is not None else []  # a blend's 0 too
        if empty:
            raise ValueError(
                f"--split {cfg.split!r} leaves the {names[i]} part of {empty[0]} empty "
                f"({len(IndexedDataset(empty[0]))} documents): give that part 0 (e.g. 90,10,0) "
                "or use more data"
            )


def _empty_parts(cfg, i: int) -> list[str]:
    """The prefixes whose part ``i`` of ``--split`` (0 train, 1 valid, 2 test) holds no
    document ([] where the split gives that part nothing at all)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    part = cfg.split_matrix[i]
    if part is None:
        return []
    out = []
    for prefix in cfg.blend[0]:
        n = len(IndexedDataset(prefix))
        if int(round(part[1] * n)) - int(round(part[0] * n)) <= 0:
            out.append(prefix)
    return out


def global_batches(args: argparse.Namespace, dataset, start: int = 0):
    """Yield, per iteration from ``start``, this DP rank's micro-batches of the global
    batch (full sequence). With ``--hybrid-context-parallel`` every rank gets every DP
    replica's: micro-batch m holds each replica's m-th micro-batch rows, replica by
    replica (``[DP x micro-batch size, S]``)."""
    from megatron.core import parallel_state

    gbs, mbs = args.global_batch_size, args.micro_batch_size
    per_dp = gbs // args.data_parallel_size
    hybrid = getattr(args, "hybrid_context_parallel", False)
    replicas = range(args.data_parallel_size) if hybrid else [
        parallel_state.get_data_parallel_rank()
    ]  # fmt: skip
    it = start
    while True:
        micro = []
        for m in range(0, per_dp, mbs):
            chunk = [
                dataset[(it * gbs + dp * per_dp + m + i) % len(dataset)]
                for dp in replicas
                for i in range(min(mbs, per_dp - m))
            ]
            micro.append({k: torch.stack([torch.as_tensor(s[k]) for s in chunk]) for k in chunk[0]})
        yield micro
        it += 1
