"""Batches for a transformers causal LM on StarTrail: a full-sequence batch -> this rank's shard.

``shard_causal_lm_batch`` (one sequence per row: Megatron's zigzag) and, for a
packed row of documents (position ids restarting at 0 per document, or
transformers' flash-attention varlen kwargs), the per-document zigzag of
``packing.py``. Labels are shifted over the *global* sequence first (token i
predicts label i+1; the last gets -100, and so does each document's last token
and the padding). ``StarTrailDataLoaderAdapter`` does the same in a data loader;
``loss_normalizer`` counts the valid tokens of the global batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from ..schedule.packing import PackedLayout, lengths_from_position_ids, pack_lengths
from ..zigzag import shard_packed, zigzag_shard
from .mpu import StarTrailMPU

__all__ = [
    "IGNORE_INDEX",
    "PACKED_KEY",
    "StarTrailDataLoaderAdapter",
    "packed_row_layout",
    "shard_causal_lm_batch",
]

IGNORE_INDEX = -100
PACKED_KEY = "startrail_packed"
"""The batch key of a packed row's ``PackedLayout`` (``StarTrailDataLoaderAdapter``)."""


_PACKED = (
    "packed sequences (position_ids that restart or jump, e.g. one row of several documents "
    "from DataCollatorWithFlattening) are not supported on this path: its attention would "
    "run across the document boundaries. Pass one document per row with position_ids "
    "arange(S) (or None)"
)


def check_no_padding(attention_mask: Tensor | None) -> None:
    """Refuse an attention mask with padding (all ones, or none, is accepted)."""
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        raise ValueError(
            "attention_mask with padding is not supported by StarTrail; pack or trim the "
            "batch so every token is valid (an all-ones mask is accepted)"
        )


def check_consecutive(position_ids: Tensor, what: str) -> None:
    """Refuse position ids that do not step by one along the sequence (packed documents)."""
    if position_ids.shape[-1] > 1 and not bool((position_ids.diff(dim=-1) == 1).all()):
        raise ValueError(f"{what}: {_PACKED}")


def shard_causal_lm_batch(
    input_ids: Tensor,
    labels: Tensor | None,
    position_ids: Tensor | None,
    sp_rank: int,
    sp_size: int,
) -> dict[str, Tensor]:
    """This sequence rank's zigzag shard of a full ``[b, S]`` causal-LM batch.

    Labels are shifted over the *global* sequence first (token i predicts
    label i+1; the last gets ``-100``), then sharded; position_ids default to
    ``arange(S)`` and keep their global values; position_ids that do not step by
    one (packed documents) raise ``ValueError`` here: a model prepared with
    ``shard_inputs=True`` trains such rows (``HFHandle``). Returns ``input_ids``,
    ``position_ids`` and, with labels, ``shift_labels`` (all ``[b, S/P]``).
    """
    shard, packed = shard_batch(input_ids, labels, position_ids, sp_rank, sp_size)
    if packed is not None:
        raise ValueError(
            f"position_ids: {_PACKED}; packed rows train when the model shards them "
            "(prepare_hf_model(..., shard_inputs=True)) or through StarTrailDataLoaderAdapter"
        )
    return shard


def packed_row_layout(position_ids: Tensor | None, shape, cp_size: int) -> PackedLayout | None:
    """The ``PackedLayout`` of a packed row (position ids restarting at 0 per document,
    as ``DataCollatorWithFlattening`` makes), or ``None`` for position ids that step by one.

    ``shape``: the batch's ``(rows, S)``. ``ValueError`` naming ``position_ids`` for
    several packed rows or ids that jump inside a document.
    """
    if position_ids is None:
        return None
    pos = position_ids.expand(shape)
    if pos.shape[-1] < 2 or bool((pos.diff(dim=-1) == 1).all()):
        return None
    if shape[0] != 1:
        raise ValueError(
            f"position_ids: packed documents (position ids restarting at 0) need one row per "
            f"batch (DataCollatorWithFlattening's layout), got {shape[0]} rows"
        )
    try:
        lengths = lengths_from_position_ids(pos[0].tolist())
    except ValueError as e:
        raise ValueError(
            f"position_ids: {e} (packed sequences: the ids restart at 0 for every document)"
        ) from e
    return pack_lengths(lengths, cp_size)


_FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def position_ids_from_flash_kwargs(kwargs: dict, shape) -> Tensor | None:
    """The position ids of a packed row given as transformers' flash-attention varlen
    kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): the kwargs are
    taken out (StarTrail's attention gets the documents itself) and their boundaries become
    position ids restarting at 0 per document; ``kwargs["position_ids"]`` otherwise."""
    if all(kwargs.get(k) is None for k in _FLASH_KWARGS):
        return kwargs.get("position_ids")
    cu_q, cu_k = (kwargs.pop(k, None) for k in _FLASH_KWARGS[:2])
    for k in _FLASH_KWARGS[2:]:
        kwargs.pop(k, None)
    if cu_q is None or (cu_k is not None and not torch.equal(cu_q.cpu(), cu_k.cpu())):
        raise ValueError(
            "cu_seq_lens_q and cu_seq_lens_k must both be given and equal (self-attention of "
            "one packed row)"
        )
    cu = [int(x) for x in cu_q.tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != shape[-1] or shape[0] != 1:
        raise ValueError(
            f"cu_seq_lens_q must run from 0 to the row's length {shape[-1]} over one row "
            f"(batch {shape[0]}), got {cu}"
        )
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seq_lens_q must not decrease, got {cu}")
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    given = kwargs.get("position_ids")
    if given is not None and not torch.equal(given.expand(shape).cpu(), pos):
        raise ValueError("position_ids disagree with cu_seq_lens_q (documents restart at 0)")
    return pos.to(kwargs["input_ids"].device)


def shard_batch(input_ids, labels, position_ids, sp_rank: int, sp_size: int):
    """(this rank's shard, the PackedLayout of a packed row or None): zigzag for one
    sequence per row; per-document zigzag for one row of documents whose position ids
    restart at 0 (``DataCollatorWithFlattening``), labels ``-100`` at each document's
    last token (it predicts nothing across the boundary) and on the padding."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must be shaped like input_ids {tuple(input_ids.shape)}"
        )
    shifted = None
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    packed = packed_row_layout(position_ids, (b, s), sp_size)
    if packed is None:
        position_ids = position_ids.expand(b, s)
        out = {
            "input_ids": zigzag_shard(input_ids, sp_rank, sp_size, dim=1),
            "position_ids": zigzag_shard(position_ids, sp_rank, sp_size, dim=1),
        }
        if shifted is not None:
            out["shift_labels"] = zigzag_shard(shifted, sp_rank, sp_size, dim=1)
        return out, None
    out = {
        "input_ids": shard_packed(input_ids, packed, sp_rank, dim=1),
        "position_ids": shard_packed(position_ids.expand(1, s), packed, sp_rank, dim=1),
    }
    if shifted is not None:
        ends = [packed.cu_seqlens[d + 1] - 1 for d, n in enumerate(packed.lengths) if n]
        shifted[:, ends] = IGNORE_INDEX
        out["shift_labels"] = shard_packed(shifted, packed, sp_rank, dim=1, fill=IGNORE_INDEX)
    return out, packed


def shard_row(input_ids, labels, position_ids, mpu: StarTrailMPU):
    """(this sequence rank's shard, the layout of its documents or None) of a full batch:
    with ``startrail.hybrid_context_parallel`` placed by ``mpu.batch_schedule``
    (``hybrid.py``: a ``BatchLayout``), else ``shard_batch`` (a packed row's
    ``PackedLayout``, or None for one sequence per row)."""
    rank = mpu.get_sequence_parallel_rank()
    if mpu.batch_schedule is not None:
        return mpu.batch_schedule.shard(input_ids, labels, position_ids, rank)
    return shard_batch(
        input_ids, labels, position_ids, rank, mpu.get_sequence_parallel_world_size()
    )


def loss_normalizer(shift_labels: Tensor, mpu: StarTrailMPU) -> Tensor:
    """Valid tokens of the global batch (all replicas) / D, as DeepSpeed averages over D."""
    n = (shift_labels != IGNORE_INDEX).sum().to(torch.float64).reshape(1)  # exact count
    dist.all_reduce(n, group=mpu.sequence_data_parallel_group)
    # fp32, so that the fp32 loss stays fp32 (a float64 divisor would promote it)
    return (n / mpu.data_parallel_size).clamp_min(1.0)[0].to(torch.float32)


def check_same_batch(input_ids: Tensor, group: dist.ProcessGroup) -> None:
    """Every rank of a sequence group must pass the same full batch (one small all-reduce)."""
    w = torch.arange(1, input_ids.numel() + 1, dtype=torch.float64, device=input_ids.device)
    w = w.reshape(input_ids.shape)
    h = (input_ids.to(torch.float64) * w).sum()
    t = torch.stack([h, -h])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t[0].item() != -t[1].item():
        raise ValueError(
            "the ranks of a sequence-parallel group were given different batches; with "
            "StarTrail the P ranks of a replica must see the same full sequence (shard the data "
            "over StarTrailMPU.data_parallel_rank / data_parallel_size, not over the world)"
        )


class StarTrailDataLoaderAdapter:
    """Wraps an iterable of full-sequence batches (dicts with ``input_ids``, optional
    ``labels``/``position_ids``) and yields this sequence rank's zigzag shard:
    ``input_ids``, ``position_ids``, ``shift_labels`` and ``num_items_in_batch``.

    For a model prepared with ``shard_inputs=False``. The P ranks of a replica
    must iterate the same batches (shard the data over
    ``mpu.data_parallel_rank``); ``num_items_in_batch`` is an all-reduce. A packed
    row (position_ids restarting at 0 per document, batch of one row) is sharded per
    document and its layout passed along as ``startrail_packed``, which the prepared
    model's pre-hook removes before the model sees the batch. With
    ``startrail.hybrid_context_parallel`` each row is placed by ``mpu.batch_schedule``
    (``hybrid.py``) and its ``BatchLayout`` passed along under the same key.
    """

    def __init__(self, batches: Iterable[Mapping[str, Tensor]], mpu: StarTrailMPU):
        self.batches, self.mpu = batches, mpu

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        mpu = self.mpu
        for given in self.batches:
            batch = dict(given)
            check_no_padding(batch.get("attention_mask"))
            # flash-attention varlen kwargs (cu_seq_lens_*) become position ids
            position_ids = position_ids_from_flash_kwargs(batch, batch["input_ids"].shape)
            out, layout = shard_row(batch["input_ids"], batch.get("labels"), position_ids, mpu)
            if layout is not None:
                out[PACKED_KEY] = layout  # the prepared model's pre-hook takes it out
            if "shift_labels" in out:
                out["num_items_in_batch"] = loss_normalizer(out["shift_labels"], mpu)
            yield out
