"""Data: megatron-core's ``MockGPTDataset`` and the global batches of each iteration."""

from __future__ import annotations

import argparse

import torch

__all__ = ["build_dataset", "eod_id", "global_batches"]


def eod_id(args: argparse.Namespace) -> int:
    """The end-of-document token of the mock data's NullTokenizer: its last id."""
    return args.vocab_size - 1


def build_dataset(args: argparse.Namespace, num_samples: int):
    import logging

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)  # "Unable to save indexes"
    tok = NullTokenizer(eod_id(args))  # its eod is the last id
    cfg = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split="1,0,0",
        tokenizer=tok,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=False,  # documents go to the attention as PackedSeqParams
        eod_mask_loss=args.eod_mask_loss,
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
