"""A small GPT pre-training application on megatron-core's own parts.

Megatron-LM's ``pretrain_gpt.py`` and ``megatron.training`` are not on the
package registry, so this package gives our users a runnable equivalent
(``python -m startrail_megatron.pretrain_gpt``, ``megatron/pretrain_gpt.py``):
it accepts Megatron-LM's flag names for what it supports, builds ``GPTModel``
(local spec; the Transformer Engine spec when TE is installed on GPUs), mock
data from megatron-core's ``MockGPTDataset``, megatron-core's
``DistributedDataParallel``, shards each batch with
``get_batch_on_this_cp_rank`` (with ``--reset-attention-mask``: per document,
as packed ``PackedSeqParams`` in THD format), and trains. With ``--context-parallel-impl
startrail`` the layer spec's core attention is StarTrail's.

One concern per module, imported in this order:

  arguments    the command line (``parse_args``)
  initialize   parallel state, StarTrail's hooks and groups, seeds (``initialize`` / ``teardown``)
  model        ``GPTModel`` in DDP and its optimizer
  data         mock dataset and global batches
  step         forward/backward of a global batch, clipping, the update
  autotune     ``--startrail-team-size auto``
  checkpoint   save / load
  loop         ``train(args)``: the iterations and their log
"""

from .arguments import build_parser, parse_args, validate_args
from .autotune import autotune_team_size
from .checkpoint import load_checkpoint, save_checkpoint
from .data import build_dataset, build_datasets, eod_id, global_batches
from .initialize import initialize, teardown
from .loop import train
from .model import build_model, build_optimizer, layer_spec, transformer_config
from .step import clip_grad_norm, forward_backward, optimizer_step, pack_micro_batch, rank_device

__all__ = [
    "autotune_team_size",
    "build_dataset",
    "build_datasets",
    "build_model",
    "build_optimizer",
    "build_parser",
    "clip_grad_norm",
    "eod_id",
    "forward_backward",
    "global_batches",
    "initialize",
    "layer_spec",
    "load_checkpoint",
    "optimizer_step",
    "pack_micro_batch",
    "parse_args",
    "rank_device",
    "save_checkpoint",
    "teardown",
    "train",
    "transformer_config",
    "validate_args",
]
