"""Megatron-core integration: GPT with StarTrail CP trains exactly like CP = 1."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
)
megatron = pytest.importorskip("megatron.core")  # imported once here, before the ranks fork

from common import AllocationCap, own_rows_first_env  # noqa: E402
from harness import run_ranks  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron_common import assert_startrail_ran, startrail_proof  # noqa: E402

from startrail_megatron.megatron import StarTrailCoreAttention, apply_startrail_spec  # noqa: E402
from startrail_megatron.megatron import training as T  # noqa: E402

BASE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--mock-data",
    "--lr",
    "1e-3",
    # Megatron-LM pads the vocabulary to a multiple of this x TP: 64 keeps 128 at TP = 2,
    # so TP = 2 runs compare with TP = 1 on the same model
    "--make-vocab-size-divisible-by",
    "64",
]
GQA = ["--group-query-attention", "--num-query-groups", "2"]


def st_flags(cp: int, team, placement: str | None = None) -> list[str]:
    """StarTrail's flags for CP size ``cp`` and team size ``team``."""
    flags = ["--context-parallel-size", str(cp), "--context-parallel-impl", "startrail"]
    flags += ["--startrail-team-size", str(team)]
    return flags + (["--startrail-placement", placement] if placement else [])


def _train(rank, world, argv, steps, save=None, load=None, grads=True):
    """The entry point's own pieces, step by step; returns losses and main_grads per step."""
    args = T.parse_args(argv)
    T.initialize(args)
    try:
        model = T.build_model(args)
        opt = T.build_optimizer(args, model)
        start = T.load_checkpoint(load, model, opt) if load else 0
        batches = T.global_batches(args, T.build_dataset(args, 64 * args.global_batch_size))
        for _ in range(start):
            next(batches)
        losses, all_grads, norms = [], [], []
        for it in range(start + 1, start + steps + 1):
            losses.append(T.forward_backward(args, model, next(batches)))
            if grads:
                all_grads.append(
                    {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
                )
            norms.append(T.optimizer_step(model, opt, args.clip_grad))
            if save and it == save[1]:
                T.save_checkpoint(save[0], model, it, opt)
        return losses, all_grads, startrail_proof(args, model, steps), norms
    finally:
        T.teardown()


def _baseline(extra=(), steps=3, gbs=None):
    """The reference: the same training on one rank (CP = 1), run once per argument list in
    a test session (a run is deterministic; the CP = 4, own-rows and window tests share
    theirs). The result is shared: read it, never change it."""
    argv = BASE + list(extra) + (["--global-batch-size", str(gbs)] if gbs else [])
    return _one_rank_run(tuple(argv), steps)


@functools.cache
def _one_rank_run(argv: tuple, steps: int):
    return run_ranks(1, _train, list(argv), steps)[0]


def _assert_close_runs(got, ref, grads=True, tol=1e-5):
    """Losses (and gradients) of a run against the reference; a StarTrail run must also
    show that StarTrail ran (``_startrail_proof``)."""
    losses, g, proof = got[:3]
    ref_losses, ref_g = ref[:2]
    assert_startrail_ran(proof)  # every run compared here is a StarTrail run
    assert len(losses) == len(ref_losses), (losses, ref_losses)
    if grads:
        assert len(g) == len(ref_g) > 0, (len(g), len(ref_g))
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= tol * abs(b), (losses, ref_losses)
    if grads:
        for step, (gs, rs) in enumerate(zip(g, ref_g)):
            assert gs.keys() == rs.keys()
            for name in rs:
                err = (gs[name] - rs[name]).abs().max() / rs[name].abs().max().clamp_min(1e-30)
                assert err <= tol, f"step {step} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("team", [1, 2])
def test_gpt_startrail_cp4_matches_cp1(heads, team):
    """Losses and all-reduced gradients of 3 SGD steps (Adam's first step maps fp32 rounding
    noise of near-zero gradients onto +-lr updates, so gradient checks past step 1 use SGD;
    Adam runs are compared on losses in the other tests)."""
    extra = (GQA if heads == "gqa" else []) + ["--optimizer", "sgd"]
    ref = _baseline(extra)
    argv = BASE + extra + st_flags(4, team)
    res = run_ranks(4, _train, argv, 3)
    for r in res:  # every CP rank holds the same all-reduced gradients
        _assert_close_runs(r, ref)


RECOMPUTE = {
    "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    + ["--recompute-num-layers", "1"],
    "full-block": ["--recompute-granularity", "full", "--recompute-method", "block"]
    + ["--recompute-num-layers", "1"],
    "selective": ["--recompute-activations"],
    "selective-core-attn": ["--recompute-granularity", "selective", "--recompute-modules"]
    + ["core_attn"],
}


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_recompute_matches_cp1(recompute):
    """Activation recompute (megatron-core's, from Megatron-LM's flags) under StarTrail:
    the losses and gradients of CP = 1 without it, and the proof counts the recomputed
    attention's forward transfers again (it fails if the flags are ignored: the forward
    bytes would be the plain run's)."""
    extra = GQA + ["--optimizer", "sgd"]
    ref = _baseline(extra)
    res = run_ranks(4, _train, BASE + extra + st_flags(4, 2) + RECOMPUTE[recompute], 3)
    for r in res:
        _assert_close_runs(r, ref)


def test_recompute_redraws_the_same_dropout_masks():
    """With attention and hidden dropout, a recomputed layer must draw the masks of its
    first forward again (megatron-core's checkpoint restores the CPU generator and the RNG
    tracker): the same losses and gradients as the same layout without recompute."""
    extra = GQA + ["--optimizer", "sgd", "--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    argv = BASE + extra + st_flags(4, 2)
    plain = run_ranks(4, _train, argv, 2)
    full = run_ranks(4, _train, argv + RECOMPUTE["full-uniform"], 2)
    for got, ref in zip(full, plain):
        _assert_close_runs(got, ref, tol=1e-6)
        assert got[2]["bytes"][0]["fwd_p2p"] == 2 * ref[2]["bytes"][0]["fwd_p2p"]


def _train_tiled(rank, world, argv, steps, last_dim=None):
    """``_train``, and the stats of the tiled loss and tiled MLPs on this rank (lists, empty
    where not asked for); with ``last_dim``, also the most rows any 3-D tensor of that last
    dimension ([s, b, last_dim]: the logits, or an MLP's intermediate) had in the run."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from startrail_megatron.megatron import tiled_loss, tiled_mlp

    loss_stats, mlp_stats = [], []
    plain_loss, plain_mlp = tiled_loss.tile_lm_loss, tiled_mlp.tile_mlps

    def capture_loss(model, tokens):
        loss_stats.append(plain_loss(model, tokens))
        return loss_stats[-1]

    def capture_mlp(model, tokens):
        mlp_stats.append(plain_mlp(model, tokens))
        return mlp_stats[-1]

    class Rows(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == last_dim:
                    Rows.rows = max(Rows.rows, t.shape[0] * t.shape[1])
            return out

    tiled_loss.tile_lm_loss, tiled_mlp.tile_mlps = capture_loss, capture_mlp
    try:
        if last_dim is None:
            return (*_train(rank, world, argv, steps), loss_stats, mlp_stats)
        with Rows():
            res = _train(rank, world, argv, steps)
        return (*res, loss_stats, mlp_stats, Rows.rows)
    finally:
        tiled_loss.tile_lm_loss, tiled_mlp.tile_mlps = plain_loss, plain_mlp


@pytest.mark.parametrize("tp", [1, 2])
def test_tiled_loss_matches_the_untiled_loss(tp):
    """``--startrail-tiled-loss``: the output layer and the loss 3 local positions at a time
    (8 per rank: tiles of 3, 3, 2) give the untiled run's losses and gradients (fp32:
    1e-6 of each tensor's largest entry) and CP = 1's; under TP = 2 over the
    vocabulary-parallel output layer. The stats prove the tiling ran (a call per micro-batch
    and step, 3 tiles each)."""
    extra = GQA + ["--optimizer", "sgd"]
    tpf = ["--tensor-model-parallel-size", str(tp)] if tp > 1 else []
    cp = 4 // tp
    argv = BASE + extra + tpf + st_flags(cp, 1 if cp < 4 else 2)
    plain = run_ranks(4, _train, argv, 3)
    tiled = run_ranks(4, _train_tiled, argv + ["--startrail-tiled-loss", "3"], 3)
    ref = _baseline(extra)
    s_local = 32 // cp
    for got, want in zip(tiled, plain):
        _assert_close_runs(got[:3], want, tol=1e-6)
        _assert_close_runs(got[:3], ref, grads=tp == 1)  # TP = 2: gradients are TP shards
        (stats,) = got[4]
        assert got[5] == []  # the MLPs are not tiled
        assert stats.calls == 3 and stats.tiles == 3 * -(-s_local // 3), stats
        assert stats.max_tile_rows == 3
        assert stats.into_main_grad == 1  # the tied output weight's gradient: into DDP's buffer


@pytest.mark.parametrize("tp", [1, 2])
def test_tiled_mlp_matches_the_untiled_mlp(tp):
    """``--startrail-tiled-mlp``: every layer's MLP (SwiGLU, biases, row-parallel under TP)
    3 local positions at a time and recomputed in the backward gives the untiled run's
    losses and gradients (fp32: 1e-6 of each tensor's largest entry); the stats prove each
    layer's MLP ran tiled (a call per layer, micro-batch and step, 3 tiles each)."""
    extra = GQA + ["--optimizer", "sgd", "--swiglu"]
    tpf = ["--tensor-model-parallel-size", str(tp)] if tp > 1 else []
    cp = 4 // tp
    argv = BASE + extra + tpf + st_flags(cp, 1 if cp < 4 else 2)
    plain = run_ranks(4, _train, argv, 3)
    tiled = run_ranks(4, _train_tiled, argv + ["--startrail-tiled-mlp", "3"], 3)
    s_local = 32 // cp
    for got, want in zip(tiled, plain):
        _assert_close_runs(got[:3], want, tol=1e-6)
        assert got[4] == [] and len(got[5]) == 1, got[4:]
        stats = got[5][0]
        assert stats.layers == 2 and stats.calls == 2 * 3, stats
        assert stats.tiles == stats.calls * -(-s_local // 3) and stats.max_tile_rows == 3, stats


def _train_attention_tile(rank, world, argv, steps):
    """``_train`` with the SDPA kernel's calls watched: the largest (query rows, key rows)
    of any call in each direction, and the tile the CP group's attention was given."""
    from startrail_megatron.kernels.sdpa import SdpaKernel
    from startrail_megatron.megatron.registry import get_startrail_state, registered_cp_groups

    largest = {"fwd": (0, 0), "bwd": (0, 0), "heads": 0}
    fwd, bwd = SdpaKernel.forward, SdpaKernel.backward

    def see(way, q, k):
        a, b = largest[way]
        largest[way] = (max(a, q.shape[0]), max(b, k.shape[0]))
        largest["heads"] = max(largest["heads"], q.shape[2])

    def forward(self, q, k, v, **kw):
        see("fwd", q, k)
        return fwd(self, q, k, v, **kw)

    def backward(self, do, q, k, v, *a, **kw):
        see("bwd", q, k)
        return bwd(self, do, q, k, v, *a, **kw)

    SdpaKernel.forward, SdpaKernel.backward = forward, backward
    tiles = []
    teardown = T.teardown

    def watch_teardown():
        for g in registered_cp_groups():
            state = get_startrail_state(g)
            tiles.append((state.attention_tile, state.attention_head_chunks))
        teardown()

    T.teardown = watch_teardown
    try:
        out = _train(rank, world, argv, steps)
    finally:
        SdpaKernel.forward, SdpaKernel.backward = fwd, bwd
        T.teardown = teardown
    return out, largest, tiles


def test_attention_tile_in_the_entry_point_gives_the_same_training():
    """``--startrail-attention-tile 3``: the same losses and gradients as whole calls
    (fp32: 1e-6 of each tensor's largest entry), every kernel call at most 3 x 3 tokens
    (whole calls are larger: the tile ran) and the CP group's attention given the tile."""
    argv = BASE + GQA + ["--optimizer", "sgd"] + st_flags(4, 2)
    whole = run_ranks(4, _train_attention_tile, argv, 2)
    tiled = run_ranks(4, _train_attention_tile, argv + ["--startrail-attention-tile", "3"], 2)
    for (got, big, _), (want, small, tiles) in zip(whole, tiled):
        _assert_close_runs(want[:3], got, tol=1e-6)
        assert tiles == [(3, None)], tiles
        for way in ("fwd", "bwd"):
            assert max(small[way]) <= 3 < max(big[way]), (way, small, big)


@pytest.mark.parametrize("tp", [1, 2])
def test_attention_head_chunks_in_the_entry_point_give_the_same_training(tp):
    """``--startrail-attention-head-chunks``: the same losses and gradients as all heads at
    once (fp32: 1e-6 of each tensor's largest entry), no kernel call on more than a chunk's
    query heads (all of a rank's without: the chunks ran) and the CP group's attention given
    the setting; under TP = 2 the chunks split a TP rank's heads (8 heads, 4 KV groups: 2
    each, in chunks of 1)."""
    heads = ["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4"]
    tpf = ["--tensor-model-parallel-size", str(tp)] if tp > 1 else []
    cp, n = 4 // tp, 2
    argv = BASE + heads + tpf + ["--optimizer", "sgd"] + st_flags(cp, 1 if cp < 4 else 2)
    whole = run_ranks(4, _train_attention_tile, argv, 2)
    flag = ["--startrail-attention-head-chunks", str(n)]
    chunked = run_ranks(4, _train_attention_tile, argv + flag, 2)
    for (want, big, _), (got, small, setting) in zip(whole, chunked):
        _assert_close_runs(got[:3], want, tol=1e-6)
        assert setting == [(None, n)], setting
        assert big["heads"] == 8 // tp and small["heads"] == 8 // tp // n, (big, small)


def test_sequence_tiled_sums_parameter_gradients_holding_two_copies_at_most():
    """``sequence_tiled``'s parameter gradients, against the untiled float64 graph: a
    weight through a matmul (a fresh gradient per tile: the first is kept as the sum), a
    bias added to every row (its gradient a sum), a same-shaped parameter added to a tile
    (whose gradient is the incoming gradient itself, which must not be summed into in
    place), a parameter the run never uses (zeros), a bf16 weight (summed in fp32; float64 ones in float64). And the
    backward holds at most two weight-sized gradients (the sum and one tile's): a third, the
    previous tile's, was alive while the next was made."""
    from startrail_megatron.bench.memory import LiveTensorBytes
    from startrail_megatron.megatron.tiling import TileStats, sequence_tiled

    torch.manual_seed(0)
    rows, hid, out = 10, 6, 5
    hidden = torch.randn(rows, hid, dtype=torch.float64)
    w = torch.randn(out, hid, dtype=torch.float64)
    b = torch.randn(out, dtype=torch.float64)
    same = torch.randn(3, out, dtype=torch.float64)
    unused = torch.randn(2, dtype=torch.float64)
    wb = torch.randn(out, hid, dtype=torch.float64)

    def run(x, start, w, b, same, unused, wb):
        y = x @ w.t() + b + x.to(wb.dtype) @ wb.t()
        pad = torch.zeros_like(y)
        pad[: min(3, y.shape[0])] = same[: min(3, y.shape[0])]
        return y + pad if start == 0 else y

    def leaves(wb_dtype):
        out = [t.clone().requires_grad_() for t in (w, b, same, unused)]
        return out + [wb.to(wb_dtype, copy=True).requires_grad_()]

    for wb_dtype in (torch.float64, torch.bfloat16):  # the untiled graph, same dtypes
        params, h = leaves(wb_dtype), hidden.clone().requires_grad_()
        run(h, 0, *params).pow(2).sum().backward()
        want = [h.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        params, h = leaves(wb_dtype), hidden.clone().requires_grad_()
        tiled = functools.partial(lambda x, i, ps: run(x, i, *ps), ps=params)
        got = sequence_tiled(tiled, TileStats(tokens=4), h, *params)
        got.pow(2).sum().backward()
        grads = [h.grad] + [p.grad for p in params]
        for name, g, r in zip(["hidden", "w", "b", "same", "unused", "wb"], grads, want):
            # a bf16 weight's gradient: bf16 per tile, summed in fp32 (bf16 once untiled)
            tol = 1e-2 if (name == "wb" and wb_dtype == torch.bfloat16) else 1e-12
            assert g.shape == r.shape and g.dtype == r.dtype, (name, g.dtype, r.dtype)
            err = (g.double() - r.double()).abs().max()
            assert err <= tol * r.double().abs().max().clamp_min(1), (name, wb_dtype, err)

    big = torch.randn(4096, 64, requires_grad=True)  # 1 MiB: the output layer's role
    x = torch.randn(32, 64, requires_grad=True)
    y = sequence_tiled(lambda t, i: t @ big.t(), TileStats(tokens=8), x, big)
    with LiveTensorBytes() as live:
        base = live.current
        y.sum().backward()
        extra = live.peak - base
    assert extra < 2.5 * big.numel() * 4, extra / (big.numel() * 4)
    # a gradient penalty through the tiles: refused (its inner gradients carry no graph)
    y = sequence_tiled(lambda t, i: t @ big.t(), TileStats(tokens=8), x, big)
    with pytest.raises(RuntimeError, match="sequence-tiled MLP or loss .* no double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_sequence_tiled_adds_a_shared_weights_gradient_into_main_grad():
    """``sequence_tiled(shared=)``: a weight that another node also uses (the output layer
    tied to the word embedding) and that has Megatron DDP's fp32 ``main_grad`` takes each
    tile's gradient there, and the node returns none for it: ``main_grad`` plus the other
    use's ``.grad`` (which DDP's hook adds later) is the untiled float64 gradient. Memory:
    the tiled node's sum is not held while the embedding's gradient is made (with
    ``shared`` off, autograd holds it, the embedding's and their sum: three weights)."""
    from startrail_megatron.bench.memory import LiveTensorBytes
    from startrail_megatron.megatron.tiling import TileStats, sequence_tiled

    torch.manual_seed(0)
    vocab, hid, rows = 4096, 64, 32
    w0 = torch.randn(vocab, hid, dtype=torch.float64)
    ids = torch.randint(0, vocab, (rows,))

    def step(shared: bool, dtype):
        w = w0.to(dtype, copy=True).requires_grad_()
        w.main_grad = torch.zeros(
            vocab, hid, dtype=torch.float32 if dtype != torch.float64 else dtype
        )
        x = torch.nn.functional.embedding(ids, w)  # the embedding's use of the weight
        stats = TileStats(tokens=8)
        y = sequence_tiled(lambda t, i: t @ w.t(), stats, x, w, shared=[shared])
        with LiveTensorBytes() as live:
            base = live.current
            y.pow(2).sum().backward()
            extra = live.peak - base
        return w, stats, extra

    w = w0.clone().requires_grad_()
    x = torch.nn.functional.embedding(ids, w)
    (x @ w.t()).pow(2).sum().backward()
    want = w.grad
    for dtype in (torch.float64, torch.float32):
        got, stats, _ = step(True, dtype)
        # float64: main_grad is float64, not DDP's fp32 buffer: the usual path, nothing added
        direct = dtype == torch.float32
        assert stats.into_main_grad == int(direct)
        total = got.grad.double() + got.main_grad.double()
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert (total - want).abs().max() <= tol * want.abs().max(), dtype
        assert bool(got.main_grad.abs().sum() > 0) == direct
    size = vocab * hid * 4
    _, on, extra_on = step(True, torch.float32)
    _, off, extra_off = step(False, torch.float32)
    assert on.into_main_grad == 1 and off.into_main_grad == 0
    assert extra_on < 2.2 * size < 2.5 * size < extra_off, (extra_on / size, extra_off / size)


@pytest.mark.parametrize("recompute", [False, True])
def test_tiled_mlp_keeps_one_tiles_intermediate(recompute):
    """The largest MLP intermediate ([s, b, 2 x ffn] out of SwiGLU's first linear) a rank
    makes, forward and backward: a tile's rows with tiling, the local sequence's without;
    also under full recompute, whose first forward runs without a graph (tiled too)."""
    argv = BASE + ["--optimizer", "sgd", "--swiglu", "--seq-length", "256"] + st_flags(4, 2)
    if recompute:
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        argv += ["--recompute-num-layers", "1"]
    fc1 = 2 * 128  # SwiGLU's ffn for hidden 64 is 128 (Megatron-LM's rounding), twice in fc1
    plain = run_ranks(4, _train_tiled, argv, 1, fc1)
    tiled = run_ranks(4, _train_tiled, argv + ["--startrail-tiled-mlp", "8"], 1, fc1)
    for p, t in zip(plain, tiled):
        assert p[-1] == 64 * 2  # [s_local, b, 2 ffn]
        assert t[-1] == 8 * 2, t[-1]  # [tile, b, 2 ffn]


def test_tiled_loss_in_bf16_within_bf16s_own_error():
    """bf16 (weights, logits and loss inputs), tiled and untiled, each against the fp32 run
    (whose own error, ~1e-7, is far below bf16's): the tiled run's losses and gradients are
    as close to it as the untiled run's, up to bf16's rounding in another summation order
    (measured: losses 1e-5 - 3e-5 both, gradients 2.7e-2 tiled against 2.3e-2 untiled of
    each tensor's largest entry; bounds with a 1.5x and 2-8x margin)."""
    extra = GQA + ["--optimizer", "sgd"]
    ref = _baseline(extra, steps=2)
    plain = run_ranks(1, _train, BASE + extra + ["--bf16"], 2)[0]
    tiled = run_ranks(1, _train_tiled, BASE + extra + ["--bf16", "--startrail-tiled-loss", "3"], 2)[
        0
    ]
    (stats,) = tiled[4]
    assert stats.calls == 2 and stats.max_tile_rows == 3, stats

    def worst(run):
        losses = max(abs(a - b) / abs(b) for a, b in zip(run[0], ref[0]))
        grads = max(
            ((g[n].double() - r[n].double()).abs().max() / r[n].abs().max().clamp_min(1e-30)).item()
            for g, r in zip(run[1], ref[1])
            for n in r
        )
        return losses, grads

    (pl, pg), (tl, tg) = worst(plain), worst(tiled)
    assert tl <= 2e-4 and pl <= 2e-4, (tl, pl)
    assert tg <= max(1.5 * pg, 1e-2) and tg <= 0.06, (tg, pg)


def _train_capped(rank, world, argv, steps, cap):
    """``_train`` (losses only) with an allocation cap: every tensor an operator makes of
    ``cap`` bytes or more, forward, backward or optimizer, is recorded as (op, shape,
    bytes) and returned (recorded rather than raised, so every rank finishes its step)."""
    with AllocationCap(cap) as capped:
        losses = _train(rank, world, argv, steps, grads=False)[0]
    return losses, capped.over


def test_no_tensor_quadratic_in_the_sequence_nor_sequence_by_vocabulary():
    """With the tiled loss, the tiled MLP and full recompute, a step at 8,192 tokens (2,048
    per rank) makes no tensor of 3 MiB or more anywhere (forward, recompute, backward,
    optimizer): not the [tokens, vocab] logits (2,048 x 4,097 fp32 = 32 MiB per rank), no
    attention mask quadratic in the sequence (the local one alone, 2,048^2 bytes, is 4
    MiB). So under a 3 MiB allocation limit no such tensor could have been allocated (the
    largest left are linear: [tokens, 4 hidden], 2 MiB, and the embedding's gradient in
    fp64). With the tiled loss off the same step does make the logits, and fails."""
    cap = 3 * 2**20
    argv = BASE + GQA + ["--optimizer", "sgd", "--swiglu", "--vocab-size", "4096"]
    argv += ["--make-vocab-size-divisible-by", "1", "--seq-length", "8192"]
    argv += ["--micro-batch-size", "1", "--startrail-tiled-mlp", "128"]
    argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    argv += ["--recompute-num-layers", "1"] + st_flags(4, 2)
    tiled = run_ranks(4, _train_capped, argv + ["--startrail-tiled-loss", "64"], 1, cap)
    for losses, over in tiled:
        assert over == [], over
        assert len(losses) == 1 and 8.0 < losses[0] < 8.7  # ln(4096) = 8.3: it trained
    untiled = run_ranks(4, _train_capped, argv, 1, cap)
    for _, over in untiled:
        assert any(shape[-1] >= 4096 and 2048 in shape for _, shape, _ in over), over[:5]


def _train_fused_loss(rank, world, argv, steps):
    """``_train``, and how many times megatron-core's fused cross-entropy ran on this rank."""
    from megatron.core.models.common.language_module import language_module as lm

    plain, calls = lm.fused_vocab_parallel_cross_entropy, []

    def counted(*a, **kw):
        calls.append(1)
        return plain(*a, **kw)

    lm.fused_vocab_parallel_cross_entropy = counted
    try:
        return (*_train(rank, world, argv, steps), len(calls))
    finally:
        lm.fused_vocab_parallel_cross_entropy = plain


def test_cross_entropy_loss_fusion_runs_megatron_cores_fused_loss():
    """``--cross-entropy-loss-fusion``: megatron-core's own fused cross-entropy (the call
    count proves it ran: a micro-batch per step) gives the unfused run's losses (1e-6) and
    gradients within bf16 rounding (megatron-core's 'native' implementation rounds the
    logits gradient to bf16, by design)."""
    argv = BASE + GQA + ["--optimizer", "sgd"] + st_flags(4, 2)
    plain = run_ranks(4, _train, argv, 2)
    fused = run_ranks(4, _train_fused_loss, argv + ["--cross-entropy-loss-fusion"], 2)
    for got, want in zip(fused, plain):
        assert got[4] == 2  # one micro-batch per step
        _assert_close_runs(got[:3], want, grads=False, tol=1e-6)
        _assert_close_runs(got[:3], want, tol=2e-2)
    with pytest.raises(AssertionError):  # not bitwise: the bf16 gradient is visible
        for got, want in zip(fused, plain):
            _assert_close_runs(got[:3], want, tol=1e-7)


def test_tiled_loss_never_makes_the_whole_logits():
    """The largest logits tensor a rank makes, forward and backward: a tile's rows with
    tiling, the whole local sequence's without (the test fails with the tiling off)."""
    argv = BASE + ["--optimizer", "sgd", "--seq-length", "256"] + st_flags(4, 2)
    vocab = 128  # mock data's 127 ids and the end-of-document id, padded to a multiple of 64
    plain = run_ranks(4, _train_tiled, argv, 1, vocab)
    tiled = run_ranks(4, _train_tiled, argv + ["--startrail-tiled-loss", "8"], 1, vocab)
    for p, t in zip(plain, tiled):
        assert p[-1] == 64 * 2  # [s_local, b, V]: the untiled logits
        assert t[-1] == 8 * 2, t[-1]  # [tile, b, V]


def _train_own_rows_first(rank, world, argv, steps, value):
    """``_train`` under ``STARTRAIL_OWN_ROWS_FIRST=value``, and the own-row calls cut."""
    with own_rows_first_env(value) as made:
        return (*_train(rank, world, argv, steps), sum(made))


def test_gpt_own_rows_first_matches_cp1():
    """The first step's own rows first, switched on for the whole run by
    ``--startrail-own-rows-first`` or, where that says ``auto``, by the environment variable:
    the same losses and gradients as CP = 1, and every rank made own-row calls exactly when
    the setting that wins says on (the flag over the variable)."""
    extra = GQA + ["--optimizer", "sgd"]
    ref = _baseline(extra)
    argv = BASE + extra + st_flags(4, 2)
    for env, flag, split in (("on", None, True), ("on", "off", False), ("off", "on", True)):
        more = [] if flag is None else ["--startrail-own-rows-first", flag]
        res = run_ranks(4, _train_own_rows_first, argv + more, 3, env)
        for r in res:
            _assert_close_runs(r, ref)
            assert (r[-1] > 0) == split, (env, flag, r[-1])


def test_tp2_gradient_clipping_matches_cp1():
    """A tiny --clip-grad always clips: the TP-aware global norm before clipping must equal
    TP = 1's at every step (1e-6), and be above the threshold (clipping happened)."""
    extra = ["--optimizer", "sgd", "--clip-grad", "0.01"]
    ref = _baseline(extra)
    argv = BASE + extra + ["--tensor-model-parallel-size", "2"] + st_flags(2, 1)
    for r in run_ranks(4, _train, argv, 3, None, None, False):
        _assert_close_runs(r, ref, grads=False)
        norms, ref_norms = r[3], ref[3]
        assert len(norms) == len(ref_norms) == 3
        for a, b in zip(norms, ref_norms):
            assert b > 0.01 and abs(a - b) <= 1e-6 * b, (norms, ref_norms)


def _grad_norm(rank, world, argv):
    args = T.parse_args(argv)
    T.initialize(args)
    try:
        model = T.build_model(args)
        batches = T.global_batches(args, T.build_dataset(args, 4 * args.global_batch_size))
        T.forward_backward(args, model, next(batches))
        for p in model.parameters():
            p.grad = p.main_grad
        return T.clip_grad_norm(model, 0.0)
    finally:
        T.teardown()


def test_grad_norm_is_float64_exact_without_a_whole_float64_copy():
    """The clipping norm accumulates in float64 a piece at a time: the same sum as a whole
    float64 copy (uneven last piece included), and no tensor the size of the gradient in
    float64 is ever made (two of them were the step's largest fixed cost)."""
    from startrail_megatron.megatron.training.step import squared_norm_fp64

    g = torch.randn(1000, 37) * 1e3
    want = g.double().pow(2).sum()
    for chunk in (7, 1000, 37_000, 1 << 20):
        got = squared_norm_fp64(g, chunk)
        assert got.dtype == torch.float64 and abs(got - want) <= 1e-12 * want, (chunk, got, want)
    from startrail_megatron.bench.memory import LiveTensorBytes

    def extra_peak(fn) -> int:  # bytes above what was live at entry (g among them)
        with LiveTensorBytes() as live:
            base = live.current
            fn()
        return live.peak - base

    assert extra_peak(lambda: squared_norm_fp64(g, 1000)) <= 3 * 8 * 1000
    old = extra_peak(lambda: g.double().pow(2).sum())  # a whole copy: the tracker sees it
    assert old >= 2 * 8 * g.numel(), old


def test_grad_norm_counts_tp_shards_once():
    ref = run_ranks(1, _grad_norm, BASE)[0]
    argv = BASE + ["--tensor-model-parallel-size", "2"] + st_flags(2, 1)
    for norm in run_ranks(4, _grad_norm, argv):
        assert abs(norm - ref) <= 1e-6 * ref, (norm, ref)


def test_adam_losses_and_first_gradients_match():
    ref = _baseline(GQA)
    argv = BASE + GQA + st_flags(4, 2)
    res = run_ranks(4, _train, argv, 3)
    for losses, grads, proof, _ in res:
        _assert_close_runs((losses, grads[:1], proof), (ref[0], ref[1][:1]))


def test_tp2_cp2_ring_matches_cp1():
    ref = _baseline()
    argv = BASE + ["--tensor-model-parallel-size", "2"] + st_flags(2, 1)
    res = run_ranks(4, _train, argv, 3, None, None, False)
    for r in res:
        _assert_close_runs(r, ref, grads=False)


@pytest.mark.slow
def test_dp2_cp4_startrail_matches_cp1():
    ref = _baseline(gbs=4)
    argv = BASE + st_flags(4, 2, placement="ring")
    res = run_ranks(8, _train, argv, 3)
    for losses, grads, proof, _ in res:
        _assert_close_runs((losses, grads[:1], proof), (ref[0], ref[1][:1]))


def test_resume_continues_exactly(tmp_path):
    """Adam state and data position are restored: 2 + 2 steps = 4 steps."""
    ckpt = str(tmp_path / "ckpt")
    argv = BASE + GQA + st_flags(4, 2)
    straight = run_ranks(4, _train, argv, 4, (ckpt, 2), None, False)[0][0]
    resumed = run_ranks(4, _train, argv, 2, None, ckpt, False)[0][0]
    assert resumed == straight[2:]


def test_checkpoint_from_startrail_loads_into_cp1(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = BASE + st_flags(4, 2)
    st_run = run_ranks(4, _train, argv, 3, (ckpt, 2), None, False)[0]
    assert os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    cp1 = run_ranks(1, _train, BASE, 1, None, ckpt, False)[0]
    # the CP = 1 run continues from iteration 2 with the StarTrail run's weights
    assert abs(cp1[0][0] - st_run[0][2]) <= 1e-5 * abs(st_run[0][2])


# ---- specs -----------------------------------------------------------------------------


def _core_attentions(spec):
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    return [layer.submodules.self_attention.submodules.core_attention for layer in layers]


def test_spec_rewrite_local_and_decoder_block():
    local = get_gpt_layer_local_spec()
    new = apply_startrail_spec(local)
    assert _core_attentions(new) == [StarTrailCoreAttention]
    assert _core_attentions(local)[0].__name__ == "DotProductAttention"  # the input is not mutated
    assert new.submodules.mlp == local.submodules.mlp
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=3, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True
    )
    block = apply_startrail_spec(
        get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, pp_rank=0)
    )
    assert _core_attentions(block) == [StarTrailCoreAttention] * 3


def _fake_te(monkeypatch):
    """Megatron's TE spec functions made to work with stand-in TE classes (TE is absent)."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.models.backends import LocalSpecProvider

    te_classes = {}

    def stand_in(name):
        return te_classes.setdefault(name, type(name, (torch.nn.Module,), {}))

    class FakeTESpecProvider(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self):
            return stand_in("TELayerNormColumnParallelLinear")

        def core_attention(self):
            return stand_in("TEDotProductAttention")

        def row_parallel_linear(self):
            return stand_in("TERowParallelLinear")

        def fuse_layernorm_and_linear(self):
            return True

    monkeypatch.setattr(specs, "TESpecProvider", FakeTESpecProvider, raising=False)
    monkeypatch.setattr(specs, "HAVE_TE", True, raising=False)
    return specs


def test_entry_point_layer_spec_with_transformer_engine(monkeypatch):
    """Where TE is installed our entry point builds megatron-core's TE spec; its 0.16
    signature has no ``normalization`` (TENorm follows the config): no TypeError."""
    from startrail_megatron.megatron import versions

    _fake_te(monkeypatch)
    monkeypatch.setattr(versions, "have_transformer_engine", lambda: True)
    args = T.parse_args(BASE + ["--context-parallel-size", "1"])
    spec = T.layer_spec(args)
    assert spec.submodules.self_attention.submodules.core_attention.__name__ == (
        "TEDotProductAttention"
    )
    args = T.parse_args(["--nproc", "4", *BASE, *st_flags(4, 2)])
    spec = T.layer_spec(args)
    assert spec.submodules.self_attention.submodules.core_attention is StarTrailCoreAttention


def test_gpu_optimizer_clips_by_clip_grad(monkeypatch):
    """On GPUs megatron's optimizer does the clipping: it must get --clip-grad."""
    import megatron.core.optimizer as mopt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mopt, "get_megatron_optimizer", lambda cfg, models: cfg)
    for clip in ("1.0", "0.5", "0"):
        args = T.parse_args(BASE + ["--clip-grad", clip])
        assert T.build_optimizer(args, None).clip_grad == float(clip)


def test_spec_rewrite_transformer_engine_spec_without_te(monkeypatch):
    """Megatron's TE spec built with stand-in TE classes (TE is absent here)."""
    specs = _fake_te(monkeypatch)
    te_spec = specs.get_gpt_layer_with_transformer_engine_spec()
    attn = te_spec.submodules.self_attention.submodules
    assert attn.core_attention.__name__ == "TEDotProductAttention"
    new = apply_startrail_spec(te_spec)
    new_attn = new.submodules.self_attention.submodules
    assert new_attn.core_attention is StarTrailCoreAttention
    assert new_attn.linear_qkv is attn.linear_qkv and new_attn.linear_proj is attn.linear_proj


def test_module_level_spec_object():
    from startrail_megatron.megatron.spec import gpt_layer_local_spec

    assert _core_attentions(gpt_layer_local_spec) == [StarTrailCoreAttention]


# ---- flags ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--context-parallel-impl", "ring"], "--context-parallel-impl: invalid choice: 'ring'"),
        (
            st_flags(4, 3),
            "--startrail-team-size 3 does not fit --context-parallel-size 4",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--context-parallel-impl",
                "startrail",
                "--seq-length",
                "36",
            ],
            "--seq-length 36 must be divisible by 2 * --context-parallel-size = 8",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--context-parallel-impl",
                "startrail",
                "--attention-dropout",
                "1.0",
            ],
            "--attention-dropout 1.0: StarTrail needs 0 <= it < 1",
        ),
        (
            st_flags(4, 2) + ["--window-size", "6,6"],
            "--window-size 6,6: a causal layer's window takes right = 0 (6,0)",
        ),
        (["--startrail-placement", "node"], "--startrail-placement: invalid choice: 'node'"),
        (
            st_flags(8, 1) + ["--startrail-ulysses-size", "3"],
            "--startrail-ulysses-size 3 does not fit --context-parallel-size 8: it must divide "
            "it; allowed: [1, 2, 4, 8]",
        ),
        (
            st_flags(8, 2) + ["--startrail-ulysses-size", "4"],
            "--startrail-team-size 2 does not fit the 2 ranks per ring group "
            "(--context-parallel-size 8 / --startrail-ulysses-size 4)",
        ),
        (
            st_flags(8, 1) + ["--startrail-ulysses-size", "8", "--num-attention-heads", "4"],
            "--startrail-ulysses-size 8 with --num-attention-heads 4, --num-query-groups 4 and "
            "--tensor-model-parallel-size 1: ulysses_size=8 must divide the query heads (4)",
        ),
        (
            st_flags(8, 1) + ["--startrail-ulysses-size", "2", "--attention-dropout", "0.1"],
            "--attention-dropout 0.1 is not supported with --startrail-ulysses-size 2 yet",
        ),
        (
            st_flags(8, "auto") + ["--startrail-ulysses-size", "2"],
            "--startrail-team-size auto is not supported with --startrail-ulysses-size > 1",
        ),
        (["--context-parallel-size", "4"], "--context-parallel-impl te needs Transformer Engine"),
        (
            ["--recompute-granularity", "full"],
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers",
        ),
        (
            RECOMPUTE["full-uniform"][:-1] + ["3"],
            "--recompute-num-layers 3 must be between 1 and --num-layers 2",
        ),
        (["--recompute-method", "block"], "--recompute-method needs --recompute-granularity"),
        (
            ["--recompute-activations", "--recompute-num-layers", "1"],
            "--recompute-granularity selective takes no --recompute-method nor "
            "--recompute-num-layers",
        ),
        (
            ["--recompute-activations", "--recompute-granularity", "full"],
            "--recompute-activations is --recompute-granularity selective; it contradicts",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "moe"],
            "--recompute-modules: invalid choice: 'moe'",
        ),
        (
            st_flags(4, 2) + ["--seq-length", "32", "--startrail-tiled-loss", "9"],
            "--startrail-tiled-loss 9 must be between 1 and the local sequence, --seq-length 32 "
            "/ --context-parallel-size 4 = 8 tokens",
        ),
        (["--startrail-tiled-loss", "0"], "--startrail-tiled-loss 0 must be between 1"),
        (
            st_flags(4, 2) + ["--seq-length", "32", "--startrail-tiled-mlp", "9"],
            "--startrail-tiled-mlp 9 must be between 1 and the local sequence",
        ),
        (
            st_flags(4, 2) + ["--seq-length", "32", "--startrail-attention-tile", "9"],
            "--startrail-attention-tile 9 must be between 1 and the local sequence, "
            "--seq-length 32 / --context-parallel-size 4 = 8 tokens",
        ),
        (
            st_flags(4, 2) + ["--startrail-attention-tile", "0"],
            "--startrail-attention-tile 0 must be between 1",
        ),
        (
            ["--startrail-attention-tile", "4"],
            "--startrail-attention-tile 4 cuts StarTrail's attention calls: it needs "
            "--context-parallel-impl startrail",
        ),
        (
            st_flags(4, 2) + GQA + ["--startrail-attention-head-chunks", "3"],
            "--startrail-attention-head-chunks 3 must divide the KV heads each rank's attention "
            "runs: 2 KV heads / --tensor-model-parallel-size 1 = 2; allowed: [1, 2]",
        ),
        (
            st_flags(4, 2) + ["--startrail-attention-head-chunks", "0"],
            "--startrail-attention-head-chunks 0 must be an integer >= 1",
        ),
        (
            ["--startrail-attention-head-chunks", "2"],
            "--startrail-attention-head-chunks 2 splits StarTrail's attention: it needs "
            "--context-parallel-impl startrail",
        ),
        (
            st_flags(4, 2)
            + ["--startrail-attention-head-chunks", "2", "--attention-dropout", "0.1"],
            "--startrail-attention-head-chunks 2 with --attention-dropout 0.1 is not supported yet",
        ),
        (
            ["--startrail-tiled-loss", "2", "--cross-entropy-loss-fusion"],
            "--startrail-tiled-loss replaces the loss, so --cross-entropy-loss-fusion would have "
            "no effect",
        ),
        (
            ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
            "--cross-entropy-fusion-impl te needs Transformer Engine; allowed here: native",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "core_attn", "mlp"],
            "--recompute-modules mlp is not supported yet",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "layernorm"],
            "--recompute-modules layernorm needs Transformer Engine, which is not installed",
        ),
    ],
)
def test_bad_flags_fail_at_parsing(flags, needle, capsys):
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--nproc", "4", *flags])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_tiled_loss_flag_under_upstream_megatron_lm():
    """Megatron-LM's parser (StarTrail's flags through ``extra_args_provider``): the tile
    within the local sequence, and only with StarTrail's hooks on (they tile the model)."""
    import argparse

    from startrail_megatron.megatron.arguments import add_startrail_args, validate_startrail_args

    def upstream(*flags):
        p = argparse.ArgumentParser()
        p.add_argument("--context-parallel-size", type=int, default=1)
        p.add_argument("--seq-length", type=int, default=64)
        p.add_argument("--cp-comm-type", nargs="+", default=["p2p"])
        p.add_argument("--mtp-num-layers", type=int, default=None)
        p.add_argument("--calculate-per-token-loss", action="store_true")
        return validate_startrail_args(add_startrail_args(p).parse_args(list(flags)))

    with pytest.raises(
        ValueError,
        match="--startrail-team-size 2, --startrail-placement ring "
        "without --context-parallel-impl startrail would be ignored",
    ):
        upstream("--context-parallel-size", "4", "--startrail-team-size", "2",
                 "--startrail-placement", "ring")  # fmt: skip
    upstream("--cp-comm-type", "p2p", *st_flags(4, 2))
    with pytest.raises(ValueError, match="--cp-comm-type a2a: StarTrail's transfers follow"):
        upstream("--cp-comm-type", "a2a", *st_flags(4, 2))  # it was ignored
    with pytest.warns(UserWarning, match="--mtp-num-layers at --context-parallel-size > 1"):
        upstream("--mtp-num-layers", "1", *st_flags(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # per-token loss: CP = 1's, nothing to say
        upstream("--mtp-num-layers", "1", "--calculate-per-token-loss", *st_flags(4, 2))

    upstream("--startrail-tiled-loss", "16", *st_flags(4, 2))
    with pytest.raises(ValueError, match="needs --context-parallel-impl startrail under"):
        upstream("--startrail-tiled-loss", "16")
    with pytest.raises(ValueError, match="--startrail-tiled-loss 17 must be between 1 and the "):
        upstream("--startrail-tiled-loss", "17", *st_flags(4, 2))


def test_entry_point_accepts_team_size_auto():
    """Only StarTrail's own entry point runs the autotuner; Megatron-LM refuses 'auto'."""
    args = T.parse_args(["--nproc", "4", *BASE, *st_flags(4, "auto")])
    assert args.startrail_team_size == "auto"


def test_readme_main_command(tmp_path):
    """The README's main command (setup skipped: the test environment is the set-up one):
    the loss falls, and StarTrail moved fewer P2P bytes than ring attention would have."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, STARTRAIL_SKIP_SETUP="1", VENV=os.path.dirname(os.path.dirname(sys.executable))
    )
    res = subprocess.run(
        [
            "bash",
            os.path.join(root, "scripts", "run_demo.sh"),
            "--train-iters",
            "4",
            "--log-json",
            str(tmp_path / "log.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if "lm loss" in ln]
    assert len(lines) == 4
    losses = [float(ln.split("lm loss")[1].split("|")[0]) for ln in lines]
    assert losses[-1] < losses[0]
    assert "less), collectives" in lines[-1]
    log = json.loads((tmp_path / "log.json").read_text())
    assert [e["iteration"] for e in log] == [1, 2, 3, 4]
    assert [round(e["loss"], 6) for e in log] == [round(x, 6) for x in losses]
    for e in log:
        st = e["startrail"]
        assert 0 < st["p2p"] < st["ring_p2p"] and st["collective"] > 0, st


def _build_both_ways(rank, world):
    """megatron-core 0.13/0.14 pass ``model_comm_pgs`` through ``build_module``; 0.15+ call the
    class with ``pg_collection``: both build the same module and compute the same output."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    args = T.parse_args(BASE + GQA + ["--context-parallel-impl", "startrail"])
    T.initialize(args)
    try:
        cfg = T.transformer_config(args)
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        common = dict(
            config=cfg,
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            cp_comm_type=None,
            softmax_scale=None,
        )
        old = build_module(ModuleSpec(module=StarTrailCoreAttention), model_comm_pgs=pgs, **common)
        new = StarTrailCoreAttention(pg_collection=pgs, **common)
        assert old.cp_group is new.cp_group is parallel_state.get_context_parallel_group()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(8, 2, 4, 16, generator=g)
        k, v = torch.randn(8, 2, 2, 16, generator=g), torch.randn(8, 2, 2, 16, generator=g)
        a, b = old(q, k, v, None), new(q, k, v, None)
        assert a.shape == (8, 2, 64)
        assert torch.equal(a, b)
        with pytest.raises(NotImplementedError, match="packed sequences"):
            new(q, k, v, None, packed_seq_params=object())
        # attention dropout: in training only (evaluation is bitwise the module without it)
        drop = StarTrailCoreAttention(pg_collection=pgs, attention_dropout=0.3, **common)
        drop.eval()
        assert torch.equal(drop(q, k, v, None), b)
        drop.train()
        assert (drop(q, k, v, None) - b).abs().max() > 1e-3
        # groups registered for another CP group are never used: a module whose CP group has
        # none fails when it is built, naming the cause
        from types import SimpleNamespace

        other = torch.distributed.new_group([0])
        with pytest.raises(RuntimeError, match="found no StarTrail groups for its context-parall"):
            StarTrailCoreAttention(pg_collection=SimpleNamespace(cp=other), **common)
        for name in (
            "qk_clip", "log_max_attention_logit", "dynamic_context_parallel",
            "batch_invariant_mode", "fp8_dot_product_attention", "fp8_multi_head_attention",
        ):  # fmt: skip
            bad = copy.copy(cfg)
            setattr(bad, name, True)
            with pytest.raises(NotImplementedError, match=name):
                StarTrailCoreAttention(pg_collection=pgs, **{**common, "config": bad})
        with pytest.raises(NotImplementedError, match="cp_comm_type 'a2a' \\(--cp-comm-type\\)"):
            StarTrailCoreAttention(pg_collection=pgs, **{**common, "cp_comm_type": "a2a"})
        StarTrailCoreAttention(pg_collection=pgs, **{**common, "cp_comm_type": "p2p"})
        # a causal layer's window attends no later token (megatron-core's local attention
        # would attend `right` later ones: a different model, silently)
        bad = copy.copy(cfg)
        bad.window_size = (6, 6)
        with pytest.raises(ValueError, match=r"config.window_size 6,6: a causal layer's window"):
            StarTrailCoreAttention(pg_collection=pgs, **{**common, "config": bad})
        full = StarTrailCoreAttention(
            pg_collection=pgs, **{**common, "config": bad, "attn_mask_type": AttnMaskType.no_mask}
        )
        assert full.window == (6, 6)  # full attention: the right side counts
        # deterministic mode: CPU kernels are deterministic; GPU kernels refused by name
        det = copy.copy(cfg)
        det.deterministic_mode = True
        StarTrailCoreAttention(pg_collection=pgs, **{**common, "config": det})
        from startrail_megatron.megatron.refusals import deterministic_mode_error

        assert "deterministic_mode (--deterministic-mode)" in deterministic_mode_error(True)
        return True
    finally:
        T.teardown()


def test_core_attention_builds_with_either_process_group_argument():
    assert run_ranks(1, _build_both_ways) == [True]


def _tiled_loss_on_pipeline_stages(rank, world):
    """Under ``install(tiled_loss=)`` a GPTModel of a pipeline stage before the last (no
    output layer: ``post_process=False``) builds untiled; the last stage's is tiled."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from startrail_megatron.megatron import cpu_support, hooks

    cpu_support.enable_cpu_support()
    hooks.install(1, tiled_loss=8)
    try:
        parallel_state.initialize_model_parallel()
        cpu_support.cpu_manual_seed(0)
        cfg = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True
        )
        local = get_gpt_layer_local_spec()
        first = GPTModel(cfg, local, 128, 32, post_process=False)
        last = GPTModel(cfg, local, 128, 32, pre_process=False)
        return getattr(first, "tiled_loss_stats", None), last.tiled_loss_stats.tokens
    finally:
        parallel_state.destroy_model_parallel()
        hooks.uninstall()
        cpu_support.disable_cpu_support()


def test_tiled_loss_skips_pipeline_stages_without_an_output_layer():
    assert run_ranks(1, _tiled_loss_on_pipeline_stages) == [(None, 8)]


def _install_hooks(rank, world, timeout_kw):
    """install(): groups with Megatron's timeout; GPTModel's decoder and MTP specs rewritten."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from startrail_megatron.megatron import cpu_support, hooks, registry, versions

    seen = []
    create = registry.StarTrailGroups.create

    def spy(*a, **kw):
        seen.append(kw.get("timeout"))
        return create(*a, **kw)

    registry.StarTrailGroups.create = spy
    cpu_support.enable_cpu_support()
    hooks.install(1)
    try:
        parallel_state.initialize_model_parallel(**timeout_kw)
        cpu_support.cpu_manual_seed(0)
        cfg = TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            use_cpu_initialization=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            mtp_num_layers=1,
        )
        local = get_gpt_layer_local_spec()
        mtp = get_gpt_mtp_block_spec(cfg, local, use_transformer_engine=False)
        model = GPTModel(cfg, local, 128, 32, mtp_block_spec=mtp, position_embedding_type="rope")
        decoder = [type(layer.self_attention.core_attention) for layer in model.decoder.layers]
        mtp_layers = [
            type(versions.mtp_layer(layer).self_attention.core_attention)
            for layer in model.mtp.layers
        ]
        # the caller's specs are not mutated
        assert _core_attentions(versions.mtp_layer(mtp.layer_specs[0].submodules)) == [
            _core_attentions(local)[0]
        ]
        tokens = torch.randint(0, 128, (2, 32))
        pos = torch.arange(32).expand(2, 32)
        loss = model(tokens, pos, None, labels=tokens)
        loss.sum().backward()
        return decoder, mtp_layers, seen
    finally:
        registry.StarTrailGroups.create = create
        parallel_state.destroy_model_parallel()
        hooks.uninstall()
        cpu_support.disable_cpu_support()


@pytest.mark.parametrize("timeout_kw", [{}, {"distributed_timeout_minutes": 7}])
def test_install_rewrites_decoder_and_mtp_specs_and_uses_megatron_timeout(timeout_kw):
    from datetime import timedelta

    decoder, mtp, timeouts = run_ranks(1, _install_hooks, timeout_kw)[0]
    assert decoder == [StarTrailCoreAttention] * 2
    assert mtp == [StarTrailCoreAttention]
    # megatron-core's default is 30 minutes; Megatron-LM passes --distributed-timeout-minutes
    assert timeouts == [timedelta(minutes=timeout_kw.get("distributed_timeout_minutes", 30))]


def _autotune_then_train(rank, world, argv, tune=True):
    args = T.parse_args(argv)
    T.initialize(args)
    try:
        model = T.build_model(args)
        lines = T.autotune_team_size(args, model, log=None) if tune else []
        from megatron.core import parallel_state as ps

        from startrail_megatron.megatron.registry import get_startrail_state

        lay = get_startrail_state(ps.get_context_parallel_group()).groups.layout
        installed = (lay.team_size, lay.placement)  # the groups the training then uses
        opt = T.build_optimizer(args, model)
        batches = T.global_batches(args, T.build_dataset(args, 8 * args.global_batch_size))
        losses = []
        for _ in range(2):
            losses.append(T.forward_backward(args, model, next(batches)))
            T.optimizer_step(model, opt, args.clip_grad)
        return (args.startrail_team_size, args.startrail_placement), lines, losses, installed
    finally:
        T.teardown()


def test_team_size_auto_profiles_candidates_and_trains_exactly():
    extra = ["--optimizer", "sgd", "--startrail-autotune-iters", "1"]
    ref = _baseline(extra, steps=2)
    res = run_ranks(4, _autotune_then_train, BASE + extra + st_flags(4, "auto"))
    choices = {r[0] for r in res}
    assert len(choices) == 1  # every rank chose the same
    (c, placement), lines, _, _ = res[0]
    assert c in (1, 2) and placement in ("team", "ring")
    assert all(r[3] == (c, placement) for r in res)  # the chosen groups are the installed ones
    tried = [ln for ln in lines if "median" in ln]
    assert len(tried) == 2  # ring and C=2 (at P=4, G=1: both placements are the same layout)
    assert lines[-1].startswith("startrail autotune: chose")
    for _, _, losses, _ in res:
        assert len(losses) == len(ref[0])
        for a, b in zip(losses, ref[0]):
            assert abs(a - b) <= 1e-5 * abs(b)


def test_team_size_auto_leaves_the_dropout_draws_as_they_were():
    """The trials run the model in training mode, drawing dropout masks; the generators are
    restored after them, so with dropout the run trains as the same (C, placement) fixed
    does (without the restore: 1e-4 apart)."""
    extra = ["--optimizer", "sgd", "--startrail-autotune-iters", "1"]
    extra += ["--attention-dropout", "0.3", "--hidden-dropout", "0.3"]
    auto = run_ranks(4, _autotune_then_train, BASE + extra + st_flags(4, "auto"))
    c, placement = auto[0][0]
    fixed = run_ranks(4, _autotune_then_train, BASE + extra + st_flags(4, c, placement), False)
    for a, f in zip(auto, fixed):
        assert f[3] == (c, placement)
        for x, y in zip(a[2], f[2], strict=True):
            assert abs(x - y) <= 1e-7 * abs(y), (a[2], f[2])


def _release(rank, world):
    """release_startrail_groups forgets the state and destroys its team/sub-ring groups."""
    from startrail_megatron.megatron import registry

    st_state = registry.create_startrail_groups(None, 2)
    team = st_state.groups.team_group
    destroyed, real = [], torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda g=None: (destroyed.append(g), real(g))
    try:
        registry.release_startrail_groups(None)
        registry.release_startrail_groups(None)  # nothing registered: no-op
    finally:
        torch.distributed.destroy_process_group = real
    try:
        registry.get_startrail_state(None)
        registered = True
    except RuntimeError:
        registered = False
    usable = not (len(destroyed) == 1 and destroyed[0] is team)  # P = 4, C = 2: no sub-ring
    again = registry.create_startrail_groups(None, 2)  # and new groups work
    out = torch.ones(1)
    torch.distributed.all_reduce(out, group=again.groups.team_group)
    registry.release_startrail_groups(None)
    return registered, usable, out.item()


def test_release_startrail_groups():
    assert run_ranks(4, _release) == [(False, False, 2.0)] * 4


# ---- process-wide changes: scoped, undone, released ----------------------------------------


def test_cpu_support_is_scoped():
    """The CPU patches hold inside their scope only; scopes nest; leaving restores everything."""
    import megatron.core.transformer.utils as tutils
    from megatron.core.tensor_parallel import random as mrandom

    from startrail_megatron.megatron import cpu_support

    def patched_objects():
        return (
            torch.cuda.current_device,
            torch.cuda.synchronize,
            tutils.get_default_causal_mask,
            mrandom._CUDA_RNG_STATE_TRACKER,
        )

    before = patched_objects()
    assert not cpu_support.cpu_support_active()
    with cpu_support.cpu_support_enabled() as patched:
        assert patched and torch.cuda.current_device() == torch.device("cpu")
        with cpu_support.cpu_support_enabled():
            pass
        assert cpu_support.cpu_support_active()  # the inner scope leaves the outer one's
    assert not cpu_support.cpu_support_active()
    assert all(a is b for a, b in zip(patched_objects(), before))


def _initialize_then_teardown(rank, world):
    from startrail_megatron.megatron import cpu_support, hooks, registry

    current_device = torch.cuda.current_device
    args = T.parse_args(BASE + ["--context-parallel-impl", "startrail"])
    T.initialize(args)
    during = (cpu_support.cpu_support_active(), hooks.installed_config() is not None)
    n_registered = len(registry.registered_cp_groups())
    T.teardown()
    after = (cpu_support.cpu_support_active(), hooks.installed_config() is not None)
    restored = torch.cuda.current_device is current_device
    return during, n_registered, after, restored, len(registry.registered_cp_groups())


def test_teardown_undoes_what_initialize_changed():
    assert run_ranks(1, _initialize_then_teardown) == [((True, True), 1, (False, False), True, 0)]


def _destroy_releases(rank, world):
    """With the hooks, destroy_model_parallel releases StarTrail's groups: the entries and
    their communicators; a second create for the same CP group releases the first."""
    import gc
    import weakref

    from megatron.core import parallel_state

    from startrail_megatron.megatron import hooks, registry

    destroyed, real = [], torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda g=None: (destroyed.append(g), real(g))
    hooks.install(2)
    try:
        parallel_state.initialize_model_parallel(context_parallel_size=4)
        cp = parallel_state.get_context_parallel_group()
        first = registry.get_startrail_state(cp)
        first_team = first.groups.team_group
        second = registry.create_startrail_groups(cp, 2)  # replaces (releases) the first
        replaced = destroyed == [first_team] and registry.get_startrail_state(cp) is second
        ref, team = weakref.ref(second), second.groups.team_group
        del first, second
        parallel_state.destroy_model_parallel()
        gc.collect()
        # ours first (megatron-core then destroys its own gloo groups)
        released = destroyed[:2] == [first_team, team] and not registry.registered_cp_groups()
        return replaced, released, ref() is None
    finally:
        torch.distributed.destroy_process_group = real
        hooks.uninstall()


def test_destroy_model_parallel_releases_startrail_groups_fully():
    assert run_ranks(4, _destroy_releases) == [(True, True, True)] * 4


def _registry_key(rank, world):
    """The default group is one key, whether named None or given as the group object."""
    from startrail_megatron.megatron import registry

    state = registry.create_startrail_groups(None, 1)
    try:
        same = registry.get_startrail_state(torch.distributed.group.WORLD) is state
        return same, registry.registered_cp_groups() == [torch.distributed.group.WORLD]
    finally:
        registry.release_startrail_groups(torch.distributed.group.WORLD)


def test_registry_keys_the_world_group_once():
    assert run_ranks(4, _registry_key) == [(True, True)] * 4


def test_our_packed_seq_params_are_not_read_back_from_the_device():
    """The PackedSeqParams our code makes (every layer of a micro-batch gets the same one)
    carry the host lists they were made from: no layer reads its tensors back (a wait for
    the device on GPUs); anyone else's are read at every call."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from startrail_megatron.megatron import attention as A
    from startrail_megatron.schedule.packing import pack_lengths

    ours = A.packed_seq_params(pack_lengths([5, 11], 2))
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    theirs = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=10, max_seqlen_kv=10
    )
    reads, real = [], A._read_boundaries
    A._read_boundaries = lambda *a: reads.append(a[1]) or real(*a)
    try:
        for _ in range(3):  # three layers
            assert A._packed_boundaries(ours, 8) == ([0, 5, 16], [0, 8, 20])
        assert reads == []
        for _ in range(2):
            assert A._packed_boundaries(theirs, 4) == ([0, 6, 16], None)
        assert len(reads) == 2
    finally:
        A._read_boundaries = real
