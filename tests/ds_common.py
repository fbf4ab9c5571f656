"""Shared pieces of the DeepSpeed tests: the tiny Llama, its data, the reference run."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

SEQ = 16
VOCAB = 64
STEPS = 3
LR = 0.3
CLIP = 1.0  # DeepSpeed's default; the reference clips alike, so the global norm is checked too


def rank_env(rank: int, world: int) -> None:
    """What a launcher sets and DeepSpeed's engine checks (one process per rank here)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )


def tiny_llama(
    attention_dropout: float = 0.0, tied: bool = False, vocab: int = VOCAB, positions: int = 64
):
    """A 2-layer Llama-family causal LM with GQA (4 query heads, 2 KV heads), fp32, seed 0;
    ``tied``: lm_head shares the embedding's weight; ``vocab`` words, ``positions`` long."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
        attention_dropout=attention_dropout,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def global_batches(global_batch: int, steps: int = STEPS, seq: int = SEQ):
    """``steps`` global batches of (input_ids, labels) ``[global_batch, seq]`` from one seed."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (global_batch, seq), generator=g)
        out.append((ids, ids.clone()))
    return out


def reference_run(global_batch: int, model=None):
    """Single process, no sequence parallelism, no DeepSpeed: SGD with gradient clipping
    (as DeepSpeed), losses and final parameters (of ``model``, default the tiny Llama)."""
    model = tiny_llama() if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids, labels in global_batches(global_batch):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def ds_config(stage: int, dp: int, startrail: dict | None, **zero) -> dict:
    cfg = {
        "train_batch_size": dp,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 1000,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": CLIP,
        "wall_clock_breakdown": False,
    }
    if startrail is not None:
        cfg["startrail"] = startrail
    return cfg
