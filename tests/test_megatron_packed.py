"""Packed documents through megatron-core's GPTModel (model level):
``PackedSeqParams(qkv_format="thd")`` reaches StarTrail's core attention.

A StarTrail GPTModel at CP = 2, 4, 8 (C = 1, 2) runs one packed sequence of documents in
the per-document zigzag layout (``shard_packed``; RoPE per document by megatron-core's own
THD path) with the global ``cu_seqlens``; the reference is Megatron's own attention at
CP = 1 on each document separately. Checked: the loss of the batch and every parameter's
all-reduced gradient (1e-5), the per-token losses of every real token, and that StarTrail
ran on the packed layout (its local length and its ledger).
"""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
)
import megatron.core  # noqa: E402, F401  (imported once here, before the ranks fork)
from harness import run_ranks  # noqa: E402

import startrail_megatron as st  # noqa: E402
from startrail_megatron.megatron import training as T  # noqa: E402

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "512",
    "--micro-batch-size", "1", "--mock-data", "--optimizer", "sgd",
]  # fmt: skip
LENGTHS = [37, 90, 5, 124, 1, 60]
TOL = 1e-5


def _documents():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 127, (n + 1,), generator=g) for n in LENGTHS]  # + the next label


def _run(rank, world, argv):
    from megatron.core import parallel_state as ps

    from startrail_megatron.megatron.attention import packed_seq_params

    args = T.parse_args(argv)
    T.initialize(args)
    try:
        model = T.build_model(args)
        docs = _documents()
        total = float(sum(LENGTHS))  # every document token predicts its next one
        cp = ps.get_context_parallel_world_size()
        per_token, proof = [], None
        if args.context_parallel_impl != "startrail":  # reference: each document on its own
            loss = 0.0
            for d in docs:
                ids, labels = d[:-1][None], d[1:][None]
                losses = model(ids, torch.arange(ids.shape[1])[None], None, labels=labels)
                (losses.sum() / total).backward()
                loss += losses.sum().item()
                per_token.append(losses.detach()[0])
            per_token = torch.cat(per_token)
        else:
            packed = st.pack_lengths(LENGTHS, cp)
            r = ps.get_context_parallel_rank()
            tokens = st.shard_packed(torch.cat([d[:-1] for d in docs]), packed, r)[None]
            labels = st.shard_packed(torch.cat([d[1:] for d in docs]), packed, r)[None]
            mask = st.shard_packed(torch.ones(int(total)), packed, r)[None]
            pos = torch.cat([torch.arange(n) for n in LENGTHS])
            position_ids = st.shard_packed(pos, packed, r)[None]

            psp = packed_seq_params(packed)
            losses = model(tokens, position_ids, None, labels=labels, packed_seq_params=psp)
            local = (losses * mask).sum()
            (local * cp / total).backward()  # DDP averages over the CP group
            sums = local.detach().double().reshape(1)
            torch.distributed.all_reduce(sums, group=ps.get_context_parallel_group())
            loss = sums.item()
            gathered = [torch.zeros_like(losses[0]) for _ in range(cp)]
            torch.distributed.all_gather(
                gathered, losses.detach()[0].contiguous(), group=ps.get_context_parallel_group()
            )
            per_token = st.unshard_packed(gathered, packed)
            from startrail_megatron.megatron.registry import get_startrail_state

            state = get_startrail_state(ps.get_context_parallel_group())
            proof = (sorted(state.local_lengths), packed.s_local, state.ledger.bytes())
        model.finish_grad_sync()
        grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
        return loss / total, per_token, grads, proof
    finally:
        T.teardown()


@pytest.mark.parametrize("cp, team", [(2, 1), (4, 2), (8, 2)])
def test_packed_thd_batch_matches_documents_one_by_one(cp, team):
    ref_loss, ref_tokens, ref_grads, _ = run_ranks(1, _run, BASE)[0]
    argv = BASE + ["--context-parallel-size", str(cp), "--context-parallel-impl", "startrail"]
    argv += ["--startrail-team-size", str(team)]
    for loss, per_token, grads, proof in run_ranks(cp, _run, argv):
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
        assert per_token.shape == ref_tokens.shape
        assert (per_token - ref_tokens).abs().max() <= TOL * ref_tokens.abs().max()
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            err = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOL, f"{name}: {err:.2e}"
        lengths, s_local, sent = proof
        assert lengths == [s_local] and sent > 0  # StarTrail ran on the packed layout


# ---- the entry point: --reset-attention-mask trains packed documents -------------------------
TRAIN = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "100",
    "--micro-batch-size", "2", "--mock-data", "--optimizer", "sgd", "--lr", "1e-2",
]  # fmt: skip
PACKED_FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def _train_packed(rank, world, argv, steps=3):
    """The entry point's own pieces on mock documents of 1-40 tokens (several per row)."""
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    from startrail_megatron.megatron.registry import get_startrail_state

    saved = MockGPTLowLevelDataset.max_sequence_length
    MockGPTLowLevelDataset.max_sequence_length = 40
    args = T.parse_args(argv)
    T.initialize(args)
    try:
        model = T.build_model(args)
        opt = T.build_optimizer(args, model)
        batches = T.global_batches(args, T.build_dataset(args, 8 * args.global_batch_size))
        losses, docs = [], 0
        for _ in range(steps):
            micro = next(batches)
            docs += sum(int((mb["tokens"] == T.eod_id(args)).sum()) for mb in micro)
            losses.append(T.forward_backward(args, model, micro))
            T.optimizer_step(model, opt, args.clip_grad)
        state = get_startrail_state(ps.get_context_parallel_group())
        return losses, docs, sorted(state.local_lengths), state.ledger.bytes()
    finally:
        MockGPTLowLevelDataset.max_sequence_length = saved
        T.teardown()


def _st(cp, team):
    return ["--context-parallel-size", str(cp), "--context-parallel-impl", "startrail",
            "--startrail-team-size", str(team)]  # fmt: skip


def test_entry_point_trains_packed_documents_alike_at_every_cp_size():
    ref_losses, docs, lengths, _ = run_ranks(1, _train_packed, TRAIN + PACKED_FLAGS + _st(1, 1))[0]
    assert docs >= 6, docs  # the rows hold several documents
    dense = run_ranks(1, _train_packed, TRAIN + _st(1, 1))[0][0]
    # the document boundaries change the losses far beyond the tolerance (the check can fail)
    assert max(abs(a - b) / b for a, b in zip(dense, ref_losses, strict=True)) > 20 * TOL
    for cp, team in [(2, 1), (4, 1), (4, 2), (8, 2)]:
        for losses, _, lengths, sent in run_ranks(
            cp, _train_packed, TRAIN + PACKED_FLAGS + _st(cp, team)
        ):
            assert len(losses) == len(ref_losses)
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= TOL * abs(b), (cp, team, losses, ref_losses)
            assert sent > 0 and all(n % 2 == 0 for n in lengths)  # StarTrail's packed layout


def test_entry_point_trains_packed_documents_with_a_window():
    """--window-size over packed documents (the window counts positions inside each
    document): CP = 4, C = 2 trains like CP = 1, and unlike packed training without it."""
    win = ["--window-size", "7,0"]
    ref = run_ranks(1, _train_packed, TRAIN + PACKED_FLAGS + win + _st(1, 1))[0][0]
    plain = run_ranks(1, _train_packed, TRAIN + PACKED_FLAGS + _st(1, 1))[0][0]
    assert max(abs(a - b) / b for a, b in zip(plain, ref, strict=True)) > 20 * TOL
    for losses, _, _, _ in run_ranks(4, _train_packed, TRAIN + PACKED_FLAGS + win + _st(4, 2)):
        assert len(losses) == len(ref) > 0, (losses, ref)
        for a, b in zip(losses, ref):
            assert abs(a - b) <= TOL * abs(b), (losses, ref)


def test_reset_attention_mask_is_refused_without_startrail(capsys):
    with pytest.raises(SystemExit):
        T.parse_args(TRAIN + ["--reset-attention-mask"])
    assert (
        "--reset-attention-mask needs --context-parallel-impl startrail" in capsys.readouterr().err
    )
