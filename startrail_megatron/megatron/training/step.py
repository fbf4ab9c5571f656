"""One training step: forward and backward of the global batch, clipping, the update.

Loss and gradients: each rank's loss is its token-loss sum times the DP x CP
size over the global token count; megatron's DDP averages gradients over
DP x CP, so the gradient is that of the global per-token mean, whatever the
CP size or implementation (tests compare CP = 4 with CP = 1). On CPU ranks the
update clips with megatron's global-norm rule (``clip_grad_norm``); on GPUs
megatron's optimizer clips by its config.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

__all__ = [
    "clip_grad_norm",
    "forward_backward",
    "optimizer_step",
    "pack_micro_batch",
    "rank_device",
]


def pack_micro_batch(batch: dict, eod: int) -> tuple[dict, object]:
    """One micro-batch ``[b, S]`` as packed documents for this CP rank (``--reset-attention-mask``).

    Documents end at each end-of-document token and at each row's end (Megatron-LM's
    rule); the rows' documents are concatenated into one packed sequence (batch 1),
    ``packed_documents`` for this CP rank.
    """
    from megatron.core import parallel_state

    from ..attention import packed_documents
    from .hybrid import document_lengths

    tokens = batch["tokens"]
    return packed_documents(
        {k: v.reshape(-1) for k, v in batch.items()},
        document_lengths(tokens, eod),
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_context_parallel_rank(),
        tokens.device,
    )


def forward_backward(
    args: argparse.Namespace, model, micro_batches, backward: bool = True, return_tokens=False
):
    """Loss of the global batch (per-token mean over its unmasked tokens: Megatron-LM's
    ``--calculate-per-token-loss``); gradients left in ``main_grad``. ``backward=False``:
    the loss alone, no graph (the evaluation); ``return_tokens``: (loss, token count)."""
    from megatron.core import parallel_state

    from ..versions import batch_on_this_cp_rank
    from .data import eod_id

    dev = rank_device()  # also of every reduced tensor: NCCL groups take CUDA tensors only
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    n_dp_cp = dist.get_world_size(dp_cp)
    if getattr(args, "hybrid_context_parallel", False):  # every replica's rows on every rank
        from .hybrid import hybrid_forward_backward

        loss_sum, total = hybrid_forward_backward(args, model, micro_batches, dev, backward)
        if backward:
            model.finish_grad_sync()
        dist.all_reduce(loss_sum, group=dp_cp)
        return (loss_sum.item() / total, total) if return_tokens else loss_sum.item() / total
    total_tokens = torch.tensor(
        [sum(float(mb["loss_mask"].sum()) for mb in micro_batches)],
        dtype=torch.float64,
        device=dev,
    )
    dist.all_reduce(total_tokens, group=parallel_state.get_data_parallel_group())
    total = max(total_tokens.item(), 1.0)  # a batch whose every token is masked: loss 0
    loss_sum = torch.zeros(1, dtype=torch.float64, device=dev)
    for mb in micro_batches:
        batch = {k: mb[k].to(dev) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if args.reset_attention_mask:  # packed documents: per-document zigzag, THD
            batch, psp = pack_micro_batch(batch, eod_id(args))
        else:
            cp = parallel_state.get_context_parallel_group()
            batch, psp = batch_on_this_cp_rank(batch, cp), None
        with torch.set_grad_enabled(backward):
            losses = model(
                batch["tokens"],
                batch["position_ids"],
                None,
                labels=batch["labels"],
                packed_seq_params=psp,
            )
            local = (losses.float() * batch["loss_mask"]).sum()
        if backward:
            (local * n_dp_cp / total).backward()
        loss_sum += local.detach().double()
    if backward:
        model.finish_grad_sync()
    dist.all_reduce(loss_sum, group=dp_cp)
    if return_tokens:
        return loss_sum.item() / total, total
    return loss_sum.item() / total


NORM_CHUNK = 1 << 20
"""Elements per float64 piece of ``squared_norm_fp64``: 8 MiB of float64 at a time."""


def squared_norm_fp64(t: torch.Tensor, chunk: int = NORM_CHUNK) -> torch.Tensor:
    """The sum of ``t``'s squares accumulated in float64, one ``chunk`` of elements at a
    time: a whole-tensor ``t.double().pow(2)`` would hold two float64 copies of the largest
    gradient (the embedding's: 196 MiB at vocabulary 50,257 and hidden 256), the step's
    largest fixed cost."""
    flat = t.detach().reshape(-1)
    sq = torch.zeros((), dtype=torch.float64, device=t.device)
    for piece in flat.split(chunk):
        d = piece.double()
        sq += torch.dot(d, d)
    return sq


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
            sq += squared_norm_fp64(p.grad)
    dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    norm = sq.sqrt().item()
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def optimizer_step(model, optimizer, clip_grad: float = 0.0) -> float | None:
    """One update from the DDP gradients; returns the global gradient norm before clipping
    (``None`` when no clipping was asked of the CPU path)."""
    norm = None
    if isinstance(optimizer, torch.optim.Optimizer):
        for p in model.parameters():
            p.grad = p.main_grad.to(p.dtype) if p.main_grad.dtype != p.dtype else p.main_grad
        if clip_grad > 0:
            norm = clip_grad_norm(model, clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        result = optimizer.step()  # megatron's optimizer clips by its config
        norm = result[1] if isinstance(result, tuple) else None  # (success, norm, zeros)
        optimizer.zero_grad()
    model.zero_grad_buffer()
    return norm


def rank_device() -> torch.device:
    """The device of this rank's tensors (and of what it reduces): its GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
