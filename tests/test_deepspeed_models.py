"""Sliding windows, soft-capping and attention sinks through DeepSpeed.

Tiny Mistral (a window shorter than the sequence), Qwen2 (``use_sliding_window`` on its
upper layers), Gemma 2 (soft-capped logits, alternating window and global layers), Gemma 3
(window and global layers) and GPT-OSS (learned sinks ``s_aux``, alternating windows) built
from configs train with StarTrail through ``startrail_megatron.deepspeed.initialize`` with
the same losses and parameters after 3 SGD steps (gradient clipping as DeepSpeed's) as one
process running transformers' eager attention without StarTrail, at P = 4 and 8 with C = 1
and 2 (1e-5). The windows (5 of the 16 tokens) and caps change the reference's losses, and
the StarTrail runs' attention is StarTrail's on every layer (ledger and local lengths).
"""

from __future__ import annotations

import pytest
import torch
from ds_common import LR, SEQ, VOCAB, global_batches, rank_env, reference_run
from ds_common import ds_config as make_cfg
from harness import run_ranks
from test_deepspeed import _full_params, _rel, _st, _teardown

import startrail_megatron.deepspeed as sds

COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)  # fmt: skip
WINDOW = 5  # of SEQ = 16 tokens


def build(name: str, plain: bool = False):
    """A tiny model of family ``name`` (seed 0); ``plain``: without window, cap or sinks."""
    import transformers as tf

    w = None if plain else WINDOW
    if name == "mistral":
        cfg = tf.MistralConfig(**COMMON, sliding_window=w)
    elif name == "qwen2":
        cfg = tf.Qwen2Config(
            **COMMON, use_sliding_window=not plain, sliding_window=WINDOW, max_window_layers=1
        )
    elif name == "gemma2":
        cfg = tf.Gemma2Config(
            **COMMON, head_dim=8, query_pre_attn_scalar=8, sliding_window=w or SEQ,
            attn_logit_softcapping=None if plain else 2.0, final_logit_softcapping=None,
        )  # fmt: skip
    elif name == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **COMMON, head_dim=8, query_pre_attn_scalar=8, sliding_window=w or SEQ,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    elif name == "gpt_oss":
        cfg = tf.GptOssConfig(
            **COMMON, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
            sliding_window=w or SEQ, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    else:
        raise ValueError(name)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).float()
    if name == "gpt_oss" and not plain:
        with torch.no_grad():  # learned sinks, away from their zero init
            for m in model.modules():
                if hasattr(m, "sinks"):
                    m.sinks.copy_(torch.linspace(-1.0, 2.0, m.sinks.numel()))
    elif name == "gpt_oss":
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "sinks"):
                    m.sinks.fill_(-1e4)  # no sink: plain softmax
    return model


def reference(name: str, plain: bool = False):
    return reference_run(1, build(name, plain))


def _run(rank, world, name, c, ulysses=1):
    rank_env(rank, world)
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = sds.initialize(
        model=model, optimizer=opt, config=make_cfg(1, 1, _st(world, c, ulysses_size=ulysses))
    )
    losses = []
    for ids, labels in global_batches(1):
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    handle = engine.startrail_handle
    proof = (
        model.config._attn_implementation,
        sorted(handle.local_lengths),
        handle.ledger.summary(),
        getattr(engine.startrail_mpu.startrail.layout, "ulysses_size", 1),
    )
    params = _full_params(engine, 1)
    _teardown(engine)
    return losses, params, proof


_REFS: dict = {}


NO_SPLIT = [
    ("mistral", 4, 2), ("mistral", 8, 1),
    ("qwen2", 4, 1), ("qwen2", 8, 2),
    ("gemma2", 4, 2), ("gemma2", 8, 1), ("gemma2", 8, 2), ("gemma2", 4, 1),
    ("gemma3", 4, 2), ("gemma3", 8, 1),
    ("gpt_oss", 4, 2), ("gpt_oss", 8, 1), ("gpt_oss", 8, 2), ("gpt_oss", 4, 1),
]  # fmt: skip
# the 2-D split (``startrail.ulysses_size``): sinks, windows and soft-capping, KV heads sharded
SPLIT = [("gpt_oss", 8, 2, 2), ("gemma2", 4, 1, 2)]


@pytest.mark.parametrize("name, p, c, ulysses", [(*x, 1) for x in NO_SPLIT] + SPLIT)
def test_model_trains_like_one_process_eager(name, p, c, ulysses):
    if name not in _REFS:
        _REFS[name] = reference(name)
        plain = reference(name, plain=True)
        assert abs(plain[0][0] - _REFS[name][0][0]) > 1e-4  # the window/cap/sinks matter
    ref_losses, ref_params = _REFS[name]
    for losses, params, (attn, lengths, ledger, u) in run_ranks(p, _run, name, c, ulysses):
        assert attn == "startrail" and lengths == [SEQ // p] and u == ulysses
        assert ledger["fwd_p2p_bytes"] + ledger["fwd_collective_bytes"] > 0
        assert len(losses) == len(ref_losses) > 0, (losses, ref_losses)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
        worst = max(_rel(params[k].float(), ref_params[k].float()) for k in ref_params)
        assert worst <= 1e-5, worst
