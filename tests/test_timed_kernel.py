"""The benchmarks' timed kernel (bench/timed_kernel.py, Note [timed kernels]): each call
waits its modelled time and no more, the planner's kernel time of a StarTrail run is exactly
what it waits, and bad settings are refused by name."""

from __future__ import annotations

import time

import pytest
import torch

from startrail_megatron.bench.timed_kernel import (
    TimedKernel,
    dense_wait,
    ratio_matched_flops,
    timed_cluster,
    timed_rate,
)
from startrail_megatron.kernels import KERNEL_NAMES
from startrail_megatron.one_process import one_process_attention
from startrail_megatron.planner.cluster import CLUSTER_PRESETS
from startrail_megatron.planner.compute import kernel_time, startrail_work
from startrail_megatron.planner.shape import AttnShape
from startrail_megatron.planner.times import step_kernel_seconds
from startrail_megatron.schedule.layout import StarTrailLayout
from startrail_megatron.zigzag import zigzag_shard


def test_a_call_waits_its_modelled_time_and_returns_zeros_of_the_contracts_shapes():
    # 4 * 32 * 4 * 1 FLOPs per pair; 1024 causal rows: 524,800 pairs -> 0.2687 GFLOP
    kern = TimedKernel(attn_flops=0.2687e9 / 0.04, bwd_ratio=2.0, call_s=0.01)
    q = torch.randn(1024, 1, 4, 32)
    k = v = torch.randn(1024, 1, 2, 32)
    want = 0.01 + 4 * 32 * 4 * 1024 * 1025 / 2 / kern.attn_flops
    t0 = time.perf_counter()
    out, lse = kern.forward(q, k, v, causal=True, scale=0.1)
    fwd = time.perf_counter() - t0
    assert want - 1e-3 <= fwd < want + 0.25, (fwd, want)  # a loaded host wakes it late
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert lse.shape == (1, 4, 1024) and lse.dtype == torch.float32
    t0 = time.perf_counter()
    dq, dk, dv = kern.backward(out, q, k, v, out, lse, causal=True, scale=0.1)
    bwd = time.perf_counter() - t0
    assert 2 * want - 1e-3 <= bwd < 2 * want + 0.25, (bwd, want)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert kern.waited_s == pytest.approx(3 * want)
    # full (non-causal) calls count every pair
    assert kern.seconds(8, 16, 1, 4, 32, False) == pytest.approx(
        0.01 + 4 * 32 * 4 * 128 / kern.attn_flops
    )


def test_the_planner_prices_a_startrail_run_as_exactly_what_its_timed_kernel_waits():
    # P = 8, C = 2, causal, forward and backward in one process: every rank's calls
    p, c, s_local, heads_q, heads_kv, d = 8, 2, 16, 4, 2, 32
    kern = TimedKernel(attn_flops=1e15, bwd_ratio=2.5, call_s=1e-7)  # waits ~nothing
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(p * s_local, 1, h, d, generator=g) for h in (heads_q, heads_kv, heads_kv)]
    shards = [[zigzag_shard(x, r, p).clone().requires_grad_() for r in range(p)] for x in full]
    outs = one_process_attention(*shards, c, kernel=kern, own_rows_first=False)
    fwd_waited = kern.waited_s
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    bwd_waited = kern.waited_s - fwd_waited

    # the cluster the benchmarks price timed runs on (a CPU preset's tile waste and K,V
    # re-streaming switched off by it), with the kernel's fixed cost per call
    cpu = CLUSTER_PRESETS["h100-ib"].with_(
        causal_tile_waste=64.0, kv_stream_bw=1e9, kv_stream_bw_bwd=1e9, kernel_cache_bytes=1e3,
        kernel_q_blocks=((0, 32),), attn_bwd_ratio=1.7,
    )  # fmt: skip
    cl = timed_cluster(cpu, kern.attn_flops, kern.bwd_ratio).with_(kernel_overhead=kern.call_s)
    assert cl.overlap and cl.attn_bwd_ratio == 2.5
    shape = AttnShape(p, s_local, 1, heads_q, heads_kv, d, elem_bytes=4)
    lay = StarTrailLayout(p, c, "team")
    work = startrail_work(lay, True, s_local)
    priced = [sum(map(sum, step_kernel_seconds(lay, cl, shape, work, bwd))) for bwd in (0, 1)]
    assert fwd_waited == pytest.approx(priced[0], rel=1e-9)
    assert bwd_waited == pytest.approx(priced[1], rel=1e-9)
    # the last step's calls once per head group: without them the planner's calls fall short
    # (it priced them so until this test), and with the causal diagonal counted as full
    # pairs the work does
    calls_short = sum(kernel_time(cl, shape, w[0], w[1], False) for st in work for w in st)
    assert fwd_waited > calls_short * (1 + 1e-3)
    cl_pairs = cl.with_(kernel_overhead=0.0)
    pairs = sum(map(sum, step_kernel_seconds(lay, cl_pairs, shape, work, False)))
    as_full = sum(
        kernel_time(cl_pairs, shape, (w[0][0] + 2 * w[0][1], 0, 0), w[1], False)
        for st in work for w in st
    )  # fmt: skip
    assert as_full > pairs * 1.1


def test_bad_settings_are_refused_by_name_and_it_is_no_users_kernel():
    assert "timed" not in KERNEL_NAMES
    for kw, name in (
        (dict(attn_flops=0), "attn_flops"),
        (dict(attn_flops=float("nan")), "attn_flops"),
        (dict(attn_flops=1e9, bwd_ratio=-1), "bwd_ratio"),
        (dict(attn_flops=1e9, call_s=-1e-6), "call_s"),
    ):
        with pytest.raises(ValueError, match=name):
            TimedKernel(**kw)
    with pytest.raises(ValueError, match="causal"):
        TimedKernel(1e9).seconds(4, 8, 1, 1, 1, True)
    with pytest.raises(ValueError, match="matmul_flops"):
        dense_wait(1.0, 0.0)
    run = dense_wait(1e6, 1e9)  # 1 ms per token
    t0 = time.perf_counter()
    run(20)
    assert 0.019 <= time.perf_counter() - t0 < 0.25


def test_a_presets_ratio_on_an_emulated_node_link():
    """``ratio_matched_flops``: a node of the emulation then does as many attention FLOPs per
    off-node byte as a node of the preset (h100-ib: 8 x 300 TFLOP/s over 360 GB/s); on a
    slower link or with more ranks per node each rank is slower in proportion."""
    h100 = CLUSTER_PRESETS["h100-ib"]
    rate = ratio_matched_flops(h100, 25e6, 8)  # 2 x 8 at 200 Mbit/s
    assert rate == pytest.approx(8 * 300e12 / 360e9 * 25e6 / 8)  # 20.8 GFLOP/s
    assert 8 * rate / 25e6 == pytest.approx(h100.gpus_per_node * h100.attn_flops / h100.inter_bw)
    assert ratio_matched_flops(h100, 12.5e6, 4) == pytest.approx(rate)
    slower = CLUSTER_PRESETS["a100-eth"]  # one 100 GbE port per node: a higher ratio
    assert ratio_matched_flops(slower, 25e6, 8) > 10 * rate
    # the flags' values (startrail-bench, batch_measure.py): a preset on the emulated link
    from startrail_megatron.emulate import EmulationSpec

    assert timed_rate("h100-ib", EmulationSpec(2, 8, 200e6)) == pytest.approx(rate)
    assert timed_rate("12.5") == 12.5e9 and timed_rate("0") == 0.0
    assert [timed_rate(v) for v in ("-1", "nan", "inf", "fast")] == [None] * 4
    with pytest.raises(ValueError, match="needs --emulate"):
        timed_rate("h100-ib")
    for bad in (dict(node_link_bytes_s=0), dict(ranks_per_node=0), dict(node_link_bytes_s=None)):
        kw = dict(node_link_bytes_s=25e6, ranks_per_node=8) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            ratio_matched_flops(h100, **kw)


def test_batch_measure_takes_a_timed_rate_or_a_preset_and_refuses_anything_else(capsys):
    from argparse import ArgumentParser, Namespace

    from common import load_script

    from startrail_megatron.emulate import EmulationSpec

    bm = load_script("batch_measure")
    spec = EmulationSpec(2, 8, 200e6)
    cl = CLUSTER_PRESETS["h100-ib"].with_(attn_flops=7e9)
    for value, emulate, want in (
        ("host", None, 7e9),
        ("12.5", None, 12.5e9),
        ("h100-ib", "2x8", ratio_matched_flops(CLUSTER_PRESETS["h100-ib"], 25e6, 8)),
    ):
        args = Namespace(timed_kernels=value, emulate=emulate)
        bm._check_timed(ArgumentParser(), args)
        assert bm._timed_rate(args, spec, cl) == pytest.approx(want)
    for value, emulate in (("0", None), ("fast", None), ("nan", None), ("h100-ib", None)):
        with pytest.raises(SystemExit):
            bm._check_timed(ArgumentParser(), Namespace(timed_kernels=value, emulate=emulate))
        assert f"--timed-kernels {value!r}" in capsys.readouterr().err
