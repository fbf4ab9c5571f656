"""The cost model, planner CLI, calibration fit and autotuner.

Byte counts: the model's per-rank bytes and calls equal what the ledger
records in real runs of every strategy. Worked example: the paper's llama-30B
numbers. H100 preset: StarTrail ahead of ring for GPT-7B at 64K on 32 GPUs.
No timing assertions: predicted times are model outputs, not measurements.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from common import make_inputs, shard
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.planner import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    AttnShape,
    ClusterSpec,
    ModelSpec,
    Strategy,
    autotune,
    buffer_bytes,
    candidate_strategies,
    cli,
    comm_bytes,
    comm_calls,
    fit_cluster,
    fit_linear,
    kv_stream_bytes,
    memory_bytes,
    paper_comm_bytes,
    paper_memory_units,
    plan,
    predict,
    startrail_candidates,
)
from startrail_megatron.planner.calibrate import TORCH_CPU_FLASH_Q_BLOCKS
from startrail_megatron.planner.strategies import STRATEGY_KINDS, StrategyKind, attention_fn
from startrail_megatron.schedule import allgather_calls

GIB = 2**30


# ---- bytes: model == ledger ---------------------------------------------------
_SPLIT_GROUPS: dict = {}


def _ledger_run(rank, world, kind, c, placement, hq, hkv, causal, u=1):
    q, k, v, do = make_inputs(3, 8 * world, 1, hq, hkv, 16)
    local = [shard(x, rank, world, causal).float().requires_grad_() for x in (q, k, v)]
    ledger = st.CommLedger()
    strategy = Strategy(kind, c, placement, u)
    if kind == "split":  # the pool's ranks live on: groups cached per process
        key = (u, c, placement)
        if key not in _SPLIT_GROUPS:
            _SPLIT_GROUPS[key] = st.UlyssesStarTrailGroups.create(u, c, placement=placement)
        out = st.startrail_attention(*local, _SPLIT_GROUPS[key], causal=causal, ledger=ledger)
    elif strategy.spec.teams:  # the pool's ranks live on: groups from the per-process cache
        from common import groups_for

        out = st.startrail_attention(*local, groups_for(c, placement), causal=causal, ledger=ledger)
    else:  # the peers through the registry, as the benchmark runs them
        out = attention_fn(strategy, causal)(*local, ledger)
    out.backward(shard(do, rank, world, causal).float())
    return ledger.summary()


@pytest.mark.parametrize("p,hq,hkv", [(4, 8, 4), (8, 8, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_model_bytes_equal_ledger_for_every_strategy(p, hq, hkv, causal):
    shape = AttnShape(p, 8, 1, hq, hkv, 16, elem_bytes=4, acc_bytes=4, causal=causal)
    strategies = candidate_strategies(p, hq, hkv)
    kinds = {s.kind for s in strategies}
    assert kinds == {"startrail", "split", "allgather", "ulysses"}
    if p == 8:
        names = {s.name for s in strategies}
        assert {"ring", "startrail-C2-team", "startrail-C2-ring"} <= names
        assert {"ring+ulysses2", "startrail-C2-team+ulysses2", "ring+ulysses4"} <= names
    for s in strategies:
        args = (s.kind, s.team_size, s.placement, hq, hkv, causal, s.ulysses_size)
        got = run_ranks(p, _ledger_run, *args)
        want_b, want_c = comm_bytes(s, shape), comm_calls(s, shape)
        assert len(got) == len(want_b) == len(want_c) == p
        for r in range(p):
            assert (
                set(want_b[r])
                == set(want_c[r])
                == {"fwd_p2p", "bwd_p2p", "fwd_collective", "bwd_collective"}
            )
            for key in want_b[r]:
                assert got[r][f"{key}_bytes"] == want_b[r][key], (s.name, r, key)
                assert got[r][f"{key}_calls"] == want_c[r][key], (s.name, r, key)


# ---- the paper's worked example -------------------------------------------------
def test_paper_worked_example_exactly():
    # llama-30B, N = 64K, H = 6656, P = 64, C = 4, bf16; the paper's "GB" are GiB.
    ex = paper_comm_bytes(65536, 6656, 64, 4, batch=1, elem_bytes=2)
    assert ex["ring_p2p"] / GIB == 1.625
    assert ex["startrail_p2p"] / GIB == 0.40625  # printed 0.406
    assert ex["startrail_collective"] / GIB == 0.15234375  # printed 0.152
    assert round((ex["startrail_p2p"] + ex["startrail_collective"]) / GIB, 3) == 0.559  # 0.558
    # 2BNH counts K and V (B*N*H elements each, 2 bytes): 2 * 65536 * 6656 * 2 bytes.
    assert ex["ring_p2p"] == 2 * 65536 * 6656 * 2


def test_worked_example_with_exact_counts():
    """The same setting counted by the layout (what the ledger records)."""
    m = MODEL_PRESETS["llama-30b"]
    shape = AttnShape.for_model(m, 65536, 64, elem_bytes=2)
    ring = comm_bytes(Strategy("startrail", 1), shape)
    star = comm_bytes(Strategy("startrail", 4, "team"), shape)
    # Ring: P-1 = 63 steps of the local KV, not P: 63/64 of 1.625 GiB.
    assert {b["fwd_p2p"] for b in ring} == {63 * 2 * 1024 * 6656 * 2}
    assert ring[0]["fwd_p2p"] / GIB == pytest.approx(1.625 * 63 / 64)
    # StarTrail P2P: G - 1 = 3 sub-ring messages of the team KV and the placement's C = 4
    # local K,V pieces = 2BNH/C exactly, as the paper; 3 pieces on the ranks that are a
    # first holder of their own team's KV (15/16 of it).
    p2p = sorted({b["fwd_p2p"] for b in star})
    assert [x / GIB for x in p2p] == [0.40625 * 15 / 16, 0.40625]
    # Collectives: q all-gathered in bf16 = 1/4 of the paper's 4BNH(C-1)/P (K and V need
    # none: the placement sends them from each member); the partial outputs are
    # reduce-scattered in fp32 and the lse gathered in fp32.
    u = 1024 * 6656  # local tokens x H
    want = 3 * (u * 2 + 4 * 1024 * 52 * 4 + u * 4)
    assert {b["fwd_collective"] for b in star} == {want}
    assert want / GIB == pytest.approx(0.15234375 / 4 + 3 * u * 4 / GIB + 12 * 1024 * 52 * 4 / GIB)


# ---- H100 preset: GPT-7B, 64K, 32 GPUs ---------------------------------------------
def _best_startrail(pl):
    """The fastest StarTrail (C, placement) without the 2-D split: what the paper ran."""
    plain = [r for r in pl.rows if r.ulysses_size == 1 and r.strategy.startswith("startrail")]
    return min(plain, key=lambda r: r.layer_s)


def _speedups(seq_len):
    pl = plan(CLUSTER_PRESETS["h100-ib"], MODEL_PRESETS["gpt-7b"], seq_len, 32)
    rows = {r.strategy: r for r in pl.rows}
    return pl, rows, rows["ring"].layer_s / _best_startrail(pl).layer_s


def test_h100_gpt7b_64k_startrail_ahead_of_ring():
    pl, rows, speedup = _speedups(65536)
    # The paper measured +77% (C = 4) end to end; the model's per-layer margin must be of
    # that order: more than +30%, less than +300%.
    assert 1.3 < speedup < 4.0, speedup
    best = _best_startrail(pl)
    assert best.team_size in (2, 4)
    c4 = min(rows["startrail-C4-team"].layer_s, rows["startrail-C4-ring"].layer_s)
    assert c4 <= 1.10 * best.layer_s  # C = 4 within 10% of the best
    assert all(r.fits for r in pl.rows)
    # the recommendation is the fastest of the StarTrail family, the 2-D split included
    family = [r for r in pl.rows if r.strategy.startswith(("startrail", "ring"))]
    assert pl.recommended == min(family, key=lambda r: r.layer_s)
    assert pl.recommended.layer_s <= best.layer_s
    # A training iteration adds work StarTrail does not speed up (LM head, ZeRO-2
    # collectives, optimizer): its margin is below the per-layer one, still above +30%.
    ring = rows["ring"]
    assert ring.grad_sync_s == best.grad_sync_s > 0
    assert 1.3 < ring.step_s / best.step_s < speedup
    # Activation recompute reruns the forward (attention and its P2P included).
    no_rc = {
        r.strategy: r
        for r in plan(
            CLUSTER_PRESETS["h100-ib"], MODEL_PRESETS["gpt-7b"], 65536, 32, recompute=False
        ).rows
    }
    dense = (ring.layer_s - ring.attn_s - ring.attn_fwd_s) / 4  # one dense forward
    assert no_rc["ring"].layer_s == pytest.approx(ring.layer_s - ring.attn_fwd_s - dense)
    assert dense > 0
    # The gain shrinks at 128K as attention compute grows (paper: +77% -> +35%).
    _, _, speedup_128k = _speedups(131072)
    assert 1.0 < speedup_128k < speedup


def test_bytes_shrink_with_team_size_and_gqa():
    m = MODEL_PRESETS["gpt-7b"]
    shape = AttnShape.for_model(m, 65536, 64)
    fwd = {
        c: max(b["fwd_p2p"] for b in comm_bytes(Strategy("startrail", c), shape))
        for c in (1, 2, 4, 8)
    }
    kv = 2 * 1024 * 4096 * 2  # one rank's K and V, bf16
    # ring: P-1 steps; C: G = P/C^2 messages of C local KVs (C*C = P: only the placement)
    assert [fwd[c] // kv for c in (1, 2, 4, 8)] == [63, 32, 16, 8]
    gqa = AttnShape.for_model(MODEL_PRESETS["llama3-8b"], 65536, 64)
    assert (
        comm_bytes(Strategy("startrail", 2), gqa)[0]["fwd_p2p"] * 4
        == comm_bytes(Strategy("startrail", 2), shape)[0]["fwd_p2p"]
    )


# ---- memory -------------------------------------------------------------------------
def test_memory_paper_units_and_refinement():
    assert paper_memory_units(Strategy("startrail", 1), 32) == 36  # Y + 4
    assert paper_memory_units(Strategy("startrail", 4), 32) == 32 + 13  # Y + 3C + 1
    m = MODEL_PRESETS["gpt-7b"]
    shape = AttnShape.for_model(m, 65536, 32)
    mem = {c: memory_bytes(Strategy("startrail", c), shape, m) for c in (1, 2, 4)}
    assert mem[1]["total"] < mem[2]["total"] < mem[4]["total"]
    a = shape.s_local * shape.batch * m.hidden * shape.elem_bytes  # the paper's A
    # The team copies of q, k, v alone: 3C A in the paper; the refined count is above it.
    assert mem[4]["attention_work"] > 3 * 4 * a
    gqa = MODEL_PRESETS["llama3-8b"]
    g_shape = AttnShape.for_model(gqa, 65536, 32)
    mha = ModelSpec(**{**gqa.__dict__, "kv_heads": gqa.heads})
    m_shape = AttnShape.for_model(mha, 65536, 32)
    s4 = Strategy("startrail", 4)
    assert (
        memory_bytes(s4, g_shape, gqa)["attention_work"]
        < memory_bytes(s4, m_shape, mha)["attention_work"]
    )
    tiny = CLUSTER_PRESETS["a100-eth"].with_(gpu_memory=1 * GIB)
    assert not any(r.fits for r in plan(tiny, m, 65536, 32).rows)
    assert plan(tiny, m, 65536, 32).recommended is None


# ---- validation ---------------------------------------------------------------------
def test_bad_settings_raise_value_error():
    h100 = CLUSTER_PRESETS["h100-ib"]
    m = MODEL_PRESETS["gpt-7b"]
    with pytest.raises(ValueError, match="intra_bw"):
        h100.with_(intra_bw=-1.0)
    with pytest.raises(ValueError, match="kind='tree'"):
        Strategy("tree")
    with pytest.raises(ValueError, match="placement='node'"):
        Strategy("startrail", 2, "node")
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size = 64"):
        AttnShape.for_model(m, 65536 + 2, 32)
    with pytest.raises(ValueError, match="exceeds the cluster's 64 GPUs"):
        plan(h100, m, 131072, 128)
    with pytest.raises(ValueError, match="kv_heads"):
        ModelSpec("x", 1, 64, 8, 3, 256)
    shape = AttnShape(4, 8, 1, 8, 2, 16)
    with pytest.raises(ValueError, match="Ulysses needs heads_q"):
        predict(Strategy("ulysses"), h100, shape)
    assert "ulysses" not in {s.name for s in candidate_strategies(4, 8, 2)}


# ---- CLI ------------------------------------------------------------------------------
def test_cli_table_and_json(capsys):
    assert (
        cli.main(
            ["--cluster", "h100-ib", "--model", "gpt-7b", "--seq-len", "64K", "--cp-size", "32"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "<- recommended" in out and "startrail-C4-team" in out and "ring" in out
    best = plan(CLUSTER_PRESETS["h100-ib"], MODEL_PRESETS["gpt-7b"], 64 * 1024, 32).recommended
    (marked,) = [ln for ln in out.splitlines() if "<- recommended" in ln]
    assert marked.split()[0] == best.strategy, (marked, best.strategy)
    assert cli.main(["--model", "llama3-8b", "--seq-len", "128k", "--cp-size", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [r["strategy"] for r in data["rows"]]
    assert names[0] == "ring" and "ulysses" not in names  # 8 kv heads do not split over 16
    assert data["recommended"]["strategy"] in names
    assert (
        cli.main(
            ["--cluster", "a100-eth", "--gpu-memory", "1", "--seq-len", "65536", "--cp-size", "16"]
        )
        == 0
    )
    assert "NO" in capsys.readouterr().out


def test_step_memory_features_change_what_a_token_costs(capsys):
    """The whole-step model (``StepFeatures``): the tiled loss takes the vocabulary out of
    the slope, the fused cross-entropy adds a [tokens, vocab] copy, recompute and the tiled
    MLP shrink what each layer keeps, and the memory column follows the options."""
    from startrail_megatron.planner.memory import (
        StepFeatures,
        startrail_buffers,
        step_bytes_per_token,
    )

    shape = AttnShape(4, 2048, 1, 8, 2, 32, elem_bytes=4)
    work = startrail_buffers(2, shape)

    def per(vocab, **kw):
        m = ModelSpec("m", 4, 256, 8, 2, 640, gated_mlp=True, vocab=vocab)
        return step_bytes_per_token(shape, m, 2, work, StepFeatures(**kw))

    plain, big = per(50304, recompute="none"), per(128256, recompute="none")
    assert big["step"] - plain["step"] == pytest.approx(4 * (128256 - 50304))
    tiled = dict(recompute="full", tiled_loss=64, tiled_mlp=64)
    assert per(50304, **tiled)["step"] == per(128256, **tiled)["step"]  # no vocabulary term
    assert plain["step"] / per(50304, **tiled)["step"] > 10
    fused = per(50304, recompute="none", ce_fusion=True)
    assert fused["rest"] - plain["rest"] == pytest.approx(1.5 * 4 * 50304)
    assert per(50304, recompute="full")["layers"] < per(50304, recompute="selective")["layers"]
    assert per(50304, recompute="none", tiled_mlp=64)["layers"] < plain["layers"]
    for kw, msg in [
        ({"recompute": "some"}, "recompute='some'; allowed"),
        ({"tiled_loss": 0}, "tiled_loss=0 must be None or an integer >= 1"),
        ({"tiled_loss": 8, "ce_fusion": True}, "the tiled loss replaces the fused loss"),
    ]:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
            StepFeatures(**kw)
    base = ["--model", "llama3-8b", "--seq-len", "128K", "--cp-size", "16", "--json"]
    mems = {}
    for name, extra in {
        "paper": [],
        "step": ["--step-memory"],
        "tiled": ["--tiled-loss", "2048", "--tiled-mlp", "2048"],
    }.items():
        assert cli.main(base + extra) == 0
        mems[name] = json.loads(capsys.readouterr().out)["rows"][0]["memory_bytes"]
    assert mems["tiled"] < mems["step"]
    with pytest.raises(SystemExit):
        cli.main(base + ["--selective-recompute", "--no-recompute"])


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--seq-len", "64K", "--cp-size", "100"], "exceeds the cluster"),
        (["--seq-len", "1000", "--cp-size", "16"], "divisible by 2\\*cp_size"),
        (["--seq-len", "64K", "--cp-size", "8", "--intra-bw", "0"], "intra_bw"),
    ],
)
def test_cli_errors(argv, msg, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert msg.replace("\\", "") in capsys.readouterr().err


def test_cli_loads_a_saved_cluster_and_takes_a_dtype(tmp_path, capsys):
    """``--cluster-json``: a ClusterSpec's fields, or a benchmark report's emulated cluster
    (docs/bench_emulated_4x2.json, the 4 x 2 emulation of docs/performance.md section 13),
    whose predictions are the report's own; ``--dtype`` sets the element size."""
    saved = tmp_path / "cl.json"
    saved.write_text(json.dumps(CLUSTER_PRESETS["a100-eth"].__dict__))
    base = ["--model", "gpt-7b", "--seq-len", "64K", "--cp-size", "32", "--json"]
    assert cli.main(["--cluster-json", str(saved), *base]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert cli.main(["--cluster", "a100-eth", *base]) == 0
    assert from_file == json.loads(capsys.readouterr().out)
    assert cli.main(["--cluster", "a100-eth", *base, "--dtype", "fp32"]) == 0
    fp32 = json.loads(capsys.readouterr().out)
    ring = [next(r for r in d["rows"] if r["strategy"] == "ring") for d in (from_file, fp32)]
    assert ring[1]["fwd_p2p_bytes"] == 2 * ring[0]["fwd_p2p_bytes"]  # K,V in the input dtype
    report_path = os.path.join(os.path.dirname(__file__), "..", "docs", "bench_emulated_4x2.json")
    with open(report_path) as f:
        report = json.load(f)
    argv = ["--cluster-json", report_path, "--layers", "2", "--hidden", "512", "--heads", "8",
            "--kv-heads", "8", "--seq-len", "4096", "--cp-size", "8", "--dtype", "fp32",
            "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    # The report's predictions were made before the planner priced the last sub-ring step's
    # calls once per head group (``times.step_kernel_seconds``): StarTrail with a team
    # combine and a sub-ring (C = 2, G = 2 here) now costs that step's extra calls more
    # (1.5 - 4.2 % on this host's per-call cost); every other strategy is priced as then.
    grouped = {"startrail-C2-team": 1.0146, "startrail-C2-ring": 1.0420}
    for r in report["emulation"]["rows"]:
        ratio = grouped.get(r["strategy"], 1.0)
        got = rows[r["strategy"]]["attn_s"] / r["predicted_median_s"]
        assert got == pytest.approx(ratio, abs=1e-9 if ratio == 1.0 else 1e-4), r["strategy"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(SystemExit):
        cli.main(["--cluster-json", str(bad), *base])
    assert "not a cluster description" in capsys.readouterr().err


def test_parse_size():
    assert cli.parse_size("64K") == 65536 and cli.parse_size("1m") == 2**20
    with pytest.raises(Exception, match="not a size"):
        cli.parse_size("64KB")


# ---- calibration ---------------------------------------------------------------------
def test_fit_recovers_known_constants():
    alpha, bw, over, tput = 50e-6, 2e9, 1e-3, 20e9
    micro = {
        "kernel": [
            {
                "pairs": n,
                "flops": 4 * 64 * 8 * n,
                "fwd_s": over + 4 * 64 * 8 * n / tput,
                "bwd_s": 2.5 * (over + 4 * 64 * 8 * n / tput),
            }
            for n in (1024, 4096, 16384)
        ],
        "kernel_causal": [  # causal calls that also compute 100 masked pairs per row
            {
                "rows": n,
                "pairs": n * (n + 1) // 2,
                "flops": 4 * 64 * 8 * n * (n + 1) // 2,
                "fwd_s": over + 4 * 64 * 8 * (n * (n + 1) // 2 + 100 * n) / tput,
                "bwd_s": 2.5 * (over + 4 * 64 * 8 * (n * (n + 1) // 2 + 100 * n) / tput),
            }
            for n in (512, 2048)
        ],
        "buffer": [{"bytes": b, "s": b / 5e9} for b in (6 << 20, 6 << 24)],
        "p2p": [{"bytes": b, "s": alpha + b / bw} for b in (1024, 1 << 20, 1 << 22)],
        "all_gather": [
            {"bytes": 3 * b, "ranks": 4, "s": 3 * alpha + 3 * b / bw} for b in (1024, 1 << 20)
        ],
    }
    cl = fit_cluster(micro, num_ranks=4, memory_bytes=1e10)
    assert cl.intra_latency == pytest.approx(alpha, rel=1e-6)
    assert cl.intra_bw == pytest.approx(bw, rel=1e-6)
    assert cl.kernel_overhead == pytest.approx(over, rel=1e-6)
    assert cl.attn_flops == pytest.approx(tput, rel=1e-6)
    assert cl.attn_bwd_ratio == pytest.approx(2.5)
    assert cl.causal_tile_waste == pytest.approx(100)
    assert cl.mem_bw == pytest.approx(5e9)
    assert cl.reduce_scatter_via_allreduce  # gloo: clone + all-reduce + copy out
    nccl = fit_cluster(micro, num_ranks=4, memory_bytes=1e10, backend="nccl")
    assert not nccl.reduce_scatter_via_allreduce
    shape = AttnShape(4, 64, 1, 8, 8, 64, elem_bytes=4)
    for s in (Strategy("allgather"), Strategy("startrail", 2)):  # both reduce-scatter
        assert predict(s, cl, shape).attn_bwd_s > predict(s, nccl, shape).attn_bwd_s
    ring = Strategy("startrail", 1)  # no collective at all
    assert predict(ring, cl, shape).attn_s == predict(ring, nccl, shape).attn_s
    assert not cl.overlap and cl.num_gpus == 4
    assert fit_linear([(1, 1), (1, 2)], [-1.0, -2.0]) == [0.0, 0.0]
    alone = fit_cluster({**micro, "p2p": [], "all_gather": []}, num_ranks=1, memory_bytes=1e10)
    assert alone.intra_latency == 0.0 and alone.num_gpus == 1
    assert fit_cluster({**micro, "buffer": []}, num_ranks=4, memory_bytes=1e10).mem_bw == 0.0
    flat = {**micro, "kernel": [{**r, "fwd_s": 0.01} for r in micro["kernel"]]}
    degenerate = fit_cluster(flat, num_ranks=4, memory_bytes=1e10)
    assert "degenerate" in degenerate.name and degenerate.kernel_overhead == 0.0
    assert degenerate.attn_flops == pytest.approx(4 * 64 * 8 * 16384 / 0.01)
    with pytest.raises(ValueError, match=">= 2 points"):
        fit_linear([(1, 1)], [1.0])


# ---- K,V re-streaming of calls too long for the cache ------------------------------
DIMS = dict(batch=1, heads_q=8, head_dim=64, elem_bytes=4, grad_bytes=4)
CACHE = {"cache_bytes": 1 << 20, "q_blocks": TORCH_CPU_FLASH_Q_BLOCKS}


def test_kv_stream_bytes_by_hand():
    f = kv_stream_bytes
    # forward: K,V of one head = 2 * nk * 64 * 4 bytes; fits up to nk = 2048 (1 MiB)
    assert f(256, 2048, False, **CACHE, **DIMS, bwd=False) == 0.0
    # 256 queries -> 64-row blocks -> 4 passes per head, 8 heads; K and V each pass
    assert f(256, 2560, False, **CACHE, **DIMS, bwd=False) == 8 * 4 * 2 * 2560 * 64 * 4
    assert f(100, 2560, False, **CACHE, **DIMS, bwd=False) == 8 * 4 * 2 * 2560 * 64 * 4  # 32
    assert f(1024, 2560, False, **CACHE, **DIMS, bwd=False) == 8 * 4 * 2 * 2560 * 64 * 4  # 256
    assert f(256, 2560, True, **CACHE, **DIMS, bwd=False) == 8 * 4 * 2560 * 64 * 4  # causal: 1/2
    # backward: K,V,dK,dV must fit (fp32: 4 * nk * 256 B): 1024 keys fit, 1025 do not;
    # a pass reads K, V and reads + writes dK, dV
    assert f(512, 1024, False, **CACHE, **DIMS, bwd=True) == 0.0
    assert f(512, 1025, False, **CACHE, **DIMS, bwd=True) == 8 * 8 * 6 * 1025 * 64 * 4
    assert (
        f(512, 4096, False, cache_bytes=0, q_blocks=TORCH_CPU_FLASH_Q_BLOCKS, **DIMS, bwd=True) == 0
    )
    assert f(512, 4096, False, cache_bytes=1, q_blocks=(), **DIMS, bwd=True) == 0
    with pytest.raises(ValueError, match="kernel_q_blocks"):
        CLUSTER_PRESETS["h100-ib"].with_(kernel_q_blocks=((0, 0),))


def test_stream_term_adds_exactly_its_bytes_to_allgather():
    shape = AttnShape(4, 1024, 1, 8, 8, 64, elem_bytes=4, acc_bytes=4, causal=True)
    base = CLUSTER_PRESETS["h100-ib"].with_(overlap=False, kernel_overhead=0.0)
    cl = base.with_(
        kernel_cache_bytes=1 << 20,
        kernel_q_blocks=TORCH_CPU_FLASH_Q_BLOCKS,
        kv_stream_bw=1e9,
        kv_stream_bw_bwd=5e8,
    )
    ag = Strategy("allgather")
    extra_f = extra_b = 0.0
    for r in range(4):  # per rank; the step takes the slowest (the one with most keys)
        calls = allgather_calls(r, 4, True, 1024)
        sf = sum(
            kv_stream_bytes(q.stop - q.start, k.stop - k.start, c, **CACHE, **DIMS, bwd=False)
            for q, k, c in calls
        )
        sb = sum(
            kv_stream_bytes(q.stop - q.start, k.stop - k.start, c, **CACHE, **DIMS, bwd=True)
            for q, k, c in calls
        )
        extra_f, extra_b = max(extra_f, sf / 1e9), max(extra_b, sb / 5e8)
    assert extra_f > 0 and extra_b > 0  # (2P-1) s/2 = 3584 keys do not fit
    p0, p1 = predict(ag, base, shape), predict(ag, cl, shape)
    # every rank computes the same pairs, so the slowest rank is the one streaming most
    assert p1.attn_fwd_s - p0.attn_fwd_s == pytest.approx(extra_f, rel=1e-9)
    assert p1.attn_bwd_s - p0.attn_bwd_s == pytest.approx(extra_b, rel=1e-9)
    ring = Strategy("startrail", 1)  # 512-token calls: K,V fit, nothing added
    assert predict(ring, cl, shape).attn_s == predict(ring, base, shape).attn_s


def test_fit_recovers_stream_bandwidths():
    over, tput, ratio, bw_f, bw_b = 1e-3, 20e9, 2.5, 4e9, 1e9
    d, h = 64, 8

    def row(nq, nk):
        flops = 4 * d * h * nq * nk
        f = over + flops / tput
        sf = kv_stream_bytes(nq, nk, False, **CACHE, **DIMS, bwd=False)
        sb = kv_stream_bytes(nq, nk, False, **CACHE, **DIMS, bwd=True)
        return {
            "q": nq,
            "k": nk,
            "pairs": nq * nk,
            "flops": flops,
            "fwd_s": f + sf / bw_f,
            "bwd_s": ratio * f + sb / bw_b,
        }

    kernel = [row(n, n) for n in (128, 256, 512, 2048)] + [row(256, 2560), row(256, 3584)]
    micro = {
        "kernel": kernel,
        "dims": DIMS,
        "p2p": [{"bytes": b, "s": 1e-4 + b / 1e9} for b in (1024, 1 << 20)],
        "all_gather": [],
    }
    cl = fit_cluster(micro, num_ranks=4, memory_bytes=1e10, cache_bytes=1 << 20)
    assert cl.kernel_overhead == pytest.approx(over, rel=1e-6)
    assert cl.attn_flops == pytest.approx(tput, rel=1e-6)
    assert cl.attn_bwd_ratio == pytest.approx(ratio)
    assert cl.kv_stream_bw == pytest.approx(bw_f, rel=1e-6)
    assert cl.kv_stream_bw_bwd == pytest.approx(bw_b, rel=1e-6)
    assert cl.kernel_cache_bytes == 1 << 20 and cl.kernel_q_blocks == TORCH_CPU_FLASH_Q_BLOCKS
    # without a cache size (or without call shapes) the term stays off
    off = fit_cluster(micro, num_ranks=4, memory_bytes=1e10)
    assert off.kv_stream_bw == off.kv_stream_bw_bwd == 0.0 and off.kernel_cache_bytes == 0
    bare = {**micro, "dims": None}
    assert fit_cluster(bare, num_ranks=4, memory_bytes=1e10, cache_bytes=1 << 20).kv_stream_bw == 0
    # fewer than two calls that fit: the term cannot be separated from compute, so it is off
    long_only = {**micro, "kernel": [r for r in kernel if r["k"] > 2048] + kernel[:1]}
    lone = fit_cluster(long_only, num_ranks=4, memory_bytes=1e10, cache_bytes=1 << 20)
    assert lone.kv_stream_bw == 0 and "re-streaming term off" in lone.name
    # causal calls that also re-stream: the tile waste is what is left after it
    n, waste = 2048, 100  # bwd K,V,dK,dV of 2048 keys exceed 1 MiB; the fwd's fit
    cp = n * (n + 1) // 2
    t = over + 4 * d * h * (cp + waste * n) / tput
    sb = kv_stream_bytes(n, n, True, **CACHE, **DIMS, bwd=True)
    causal = {"q": n, "k": n, "causal": True, "rows": n, "pairs": cp, "flops": 4 * d * h * cp}
    causal.update(fwd_s=t, bwd_s=ratio * t + sb / bw_b)
    cw = fit_cluster(
        {**micro, "kernel_causal": [causal]}, num_ranks=4, memory_bytes=1e10, cache_bytes=1 << 20
    )
    assert sb > 0 and cw.causal_tile_waste == pytest.approx(waste, rel=1e-6)
    # the fitted spec survives a JSON round trip (tuples, hashable, equal)
    again = ClusterSpec(**json.loads(json.dumps(cl.__dict__)))
    assert again == cl and hash(again) == hash(cl)


# ---- the sub-ring steps as a pipeline, not a barrier per step -----------------------
def test_ring_pipeline_by_hand():
    from startrail_megatron.planner.times import ring_pipeline

    ov = CLUSTER_PRESETS["h100-ib"]
    no = ov.with_(overlap=False)
    # equal compute everywhere: the per-step formula, with and without overlap
    for cl in (ov, no):
        for x in (0.5, 3.0):
            comp = [[2.0] * 4 for _ in range(3)]
            step = max(2.0, x) if cl.overlap else 2.0 + x  # the per-step formula
            expect = step * 2 + 2.0
            assert ring_pipeline(cl, comp, [3, 0, 1, 2], x) == pytest.approx(expect)
            assert ring_pipeline(cl, comp, [3, 0, 1, 2], x, x) == pytest.approx(expect)
    # rank 0 heavy at step 0, rank 1 at step 1: each pays its own sum (3), not 2 + 2
    comp = [[2.0, 1.0], [1.0, 2.0]]
    assert ring_pipeline(ov, comp, [1, 0], 0.0) == pytest.approx(3.0)
    # the KV of step 1 leaves rank 0 when it starts step 0 and takes 1.5: rank 1 waits
    assert ring_pipeline(ov, comp, [1, 0], 1.5) == pytest.approx(3.5)
    # backward: rank 1 ends step 1 only when rank 0's dK/dV (sent at 2.0) arrived (+2.5)
    assert ring_pipeline(ov, comp, [1, 0], 0.0, 2.5) == pytest.approx(4.5)
    # no overlap: a rank's own transfer adds to every step but the last
    assert ring_pipeline(no, comp, [1, 0], 0.5) == pytest.approx(3.5)
    # ... and in the backward each rank waits for its dK/dV exchange after computing
    comp3 = [[2.0, 1.0], [1.0, 2.0], [1.0, 1.0]]
    assert ring_pipeline(no, comp3, [1, 0], 0.5, 0.5) == pytest.approx(5.0)
    # a transfer needs both ends: rank 1 posts its step-1 exchange late (at 3), so
    # rank 0's KV for step 2 leaves then (arrives at 4) and rank 1 waits for its own send
    late = [[0.0, 3.0], [0.0, 0.0], [1.0, 2.0]]
    assert ring_pipeline(ov, late, [1, 0], 1.0) == pytest.approx(6.0)


def test_ring_pipeline_on_shared_host_cores():
    """Ranks sharing the host's cores (an emulated cluster): a transfer's wire time overlaps
    compute but its host work adds to it: ``cpu_kv`` beside every step but the last,
    ``cpu_dkv`` beside every step but the first (backward)."""
    from startrail_megatron.planner.links import p2p_host_cpu
    from startrail_megatron.planner.times import ring_cluster, ring_pipeline

    host = CLUSTER_PRESETS["h100-ib"].with_(
        overlap=False, gpus_per_node=2, num_nodes=2, host_cores=2, host_cpu_intra=1e-9,
        host_cpu_inter=4e-9,
    )  # fmt: skip
    comp, prev = [[2.0] * 4 for _ in range(3)], [3, 0, 1, 2]
    # wire-bound steps: the wire time (3 > 2 + 0.5); compute-bound: compute + host work
    assert ring_pipeline(host, comp, prev, 3.0, 0.0, 0.5) == pytest.approx(2 * 3.0 + 2.0)
    assert ring_pipeline(host, comp, prev, 1.0, 0.0, 0.5) == pytest.approx(2 * 2.5 + 2.0)
    # backward: steps 0 and 1 beside a KV exchange, steps 1 and 2 beside a dK/dV one;
    # with a small dK/dV wire time the sum of all, with a binding one (3) step 1 ends when
    # step 0's exchange lands (2.5 + 3) and step 2 when step 1's does (5.5 + 3): 8.75 with
    # the dK/dV's host work on steps 0 and 1 instead
    got = ring_pipeline(host, comp, prev, 0.1, 0.1, 0.5, 0.25)
    assert got == pytest.approx(3 * 2.0 + 2 * 0.5 + 2 * 0.25)
    assert ring_pipeline(host, comp, prev, 0.1, 3.0, 0.5, 0.25) == pytest.approx(8.5)
    # without shared cores the transfers add to the steps as before (no overlap)
    assert ring_pipeline(host.with_(host_cores=0), comp, prev, 3.0, 0.0, 0.5) == pytest.approx(
        2 * 5.0 + 2.0
    )
    # the host work of one step, every send at once: bytes x CPU per byte of its link,
    # over the cores (ranks 0, 1 on node 0; a rank's send to itself moves nothing)
    sends = [(0, 1, 10**9), (1, 2, 10**9), (2, 2, 5)]
    assert p2p_host_cpu(host, sends) == pytest.approx((1.0 + 4.0) / 2)
    assert p2p_host_cpu(host.with_(host_cores=0), sends) == 0.0
    # the 2-D split's ring groups: U of them move their bytes on the same cores at once
    ring = ring_cluster(host, 2)
    assert (ring.host_cpu_intra, ring.host_cpu_inter) == pytest.approx((2e-9, 8e-9))


def test_links_take_the_host_cpu_where_longer_than_the_wire():
    """On shared host cores every transfer takes the longer of its wire time and the host
    work of all the bytes moving at once over the cores; without them, the wire time."""
    from startrail_megatron.planner import links

    wire = CLUSTER_PRESETS["h100-ib"].with_(
        gpus_per_node=2, num_nodes=2, intra_bw=1e9, inter_bw=1e8, inter_bw_per_gpu=1e8,
        intra_latency=0.0, inter_latency=0.0,
    )  # fmt: skip
    slow_host = wire.with_(host_cores=2, host_cpu_intra=4e-9, host_cpu_inter=2e-8)
    fast_host = wire.with_(host_cores=2, host_cpu_intra=1e-12, host_cpu_inter=1e-12)
    ring = [(0, 1, 10**8), (1, 2, 10**8), (2, 3, 10**8), (3, 0, 10**8)]
    # wire: 1 s off-node; host: (2 x 0.4 + 2 x 2) / 2 = 2.4 s
    for cl, want in ((wire, 1.0), (fast_host, 1.0), (slow_host, 2.4)):
        assert links.p2p_step(cl, ring) == pytest.approx(want)
        assert links.p2p_fan(cl, ring) == pytest.approx(want)
    # a ring all-gather over the 4 ranks, 10^8 bytes sent by each: the same edges
    assert links.collective(wire, [[0, 1, 2, 3]], 10**8, 1) == pytest.approx(1.0)
    assert links.collective(slow_host, [[0, 1, 2, 3]], 10**8, 1) == pytest.approx(2.4)
    # an all-to-all over the 4, 3 x 10^8 bytes from each: per rank 1 part inside the node,
    # 2 off it (wire 2 x 10^8 / (10^8 / 2) = 4 s); host: 4 x (0.4 + 2 x 2) / 2 = 8.8 s,
    # and twice that for two groups at once
    assert links.all_to_all(wire, 4, 3 * 10**8, 1) == pytest.approx(4.0)
    assert links.all_to_all(slow_host, 4, 3 * 10**8, 1) == pytest.approx(8.8)
    assert links.all_to_all(slow_host, 4, 3 * 10**8, 1, groups=2) == pytest.approx(17.6)


def test_all_to_all_by_hand_and_at_its_own_node_rate():
    from startrail_megatron.planner.links import all_to_all

    cl = CLUSTER_PRESETS["a100-eth"].with_(
        gpus_per_node=2, num_nodes=4, intra_bw=8e9, inter_bw=4e9, inter_bw_per_gpu=4e9,
        intra_latency=0.0, inter_latency=0.0,
    )  # fmt: skip
    # P = 8, 2 per node: 1 part inside the node, 6 off it, the node's 2 ranks sharing
    # its link (2e9 each); 7 parts of 1e9 bytes
    assert all_to_all(cl, 8, 7e9, 1) == pytest.approx(max(1e9 / 8e9, 6e9 / 2e9))
    # a measured all-to-all rate per node (many flows on its link) replaces inter_bw
    slow = cl.with_(all_to_all_inter_bw=1e9)
    assert all_to_all(slow, 8, 7e9, 1) == pytest.approx(6e9 / 0.5e9)
    # ... for the all-to-all only: the P2P links keep inter_bw
    from startrail_megatron.planner.links import p2p_step

    assert p2p_step(slow, [(0, 2, 4e9)]) == p2p_step(cl, [(0, 2, 4e9)]) == pytest.approx(1.0)
    # inside one node it never applies
    assert all_to_all(slow, 2, 1e9, 1) == all_to_all(cl, 2, 1e9, 1) == pytest.approx(1e9 / 8e9)


def test_startrail_prediction_counts_each_ranks_own_sum():
    """P = 8, C = 2: each rank holds its own team's causal diagonal at one of the two
    steps; with free links the forward kernel time is one rank's sum, below the sum of
    per-step maxima."""
    from startrail_megatron.planner.compute import kernel_time, startrail_work
    from startrail_megatron.planner.times import step_kernel_seconds
    from startrail_megatron.schedule.layout import StarTrailLayout

    cl = CLUSTER_PRESETS["h100-ib"].with_(
        intra_latency=0.0, inter_latency=0.0, intra_bw=1e30, inter_bw=1e30, inter_bw_per_gpu=1e30
    )
    cl = cl.with_(mem_bw=0.0)
    shape = AttnShape(8, 512, 1, 8, 8, 64, causal=True)
    lay = StarTrailLayout(8, 2, "team")
    work = startrail_work(lay, True, 512)
    per = step_kernel_seconds(lay, cl, shape, work, False)  # the last step per head group
    assert per[1][0] > kernel_time(cl, shape, *work[1][0][:2], False)
    own_sum = max(sum(per[s][r] for s in range(2)) for r in range(8))
    step_max = sum(max(row) for row in per)
    assert own_sum < step_max
    assert predict(Strategy("startrail", 2), cl, shape).attn_fwd_s == pytest.approx(own_sum)


def test_own_rows_first_priced_as_the_code_runs_it():
    """The first step's own rows first (``CommOptions(own_rows_first=)``): the planner
    counts the split's calls and hides the team gather behind the own rows' calls, and its
    default follows the code's rule (``own_rows_first_pays``: the team across nodes, the
    gather larger than the placement)."""
    from startrail_megatron.planner.compute import startrail_own_shapes, startrail_work
    from startrail_megatron.planner.times import startrail_times
    from startrail_megatron.schedule.layout import StarTrailLayout

    base = CLUSTER_PRESETS["h100-ib"]
    on, off = base.with_(own_rows_first=True), base.with_(own_rows_first=False)
    # the split: the same pairs, more calls at the first step, none where it is off
    lay = StarTrailLayout(32, 4, "team")
    whole, split = startrail_work(lay, True, 2048), startrail_work(lay, True, 2048, own_first=True)
    for s in range(lay.ring_size):
        for r in range(32):
            (f0, d0, _), (f1, d1, _) = whole[s][r][0], split[s][r][0]
            assert f0 + d0 == f1 + d1  # pairs (part of a diagonal block becomes full)
            assert split[s][r][1] >= whole[s][r][1] + (s == 0)  # calls
    assert all(startrail_own_shapes(lay, True, 2048, own_first=True))
    assert not any(startrail_own_shapes(lay, True, 2048))
    # GQA (4 K,V heads of 32) on the ring placement at P = 32: teams span nodes and the
    # q gather outlasts the placement; the split is faster, and the default takes it
    gqa = AttnShape(32, 2048, 1, 32, 4, 128)
    ring = StarTrailLayout(32, 2, "ring")
    t_on, t_off, t_auto = (sum(startrail_times(ring, cl, gqa, None)) for cl in (on, off, base))
    assert t_on < t_off and t_auto == t_on
    # teams inside a node (team placement), or MHA: the gather ends first; the split only
    # adds calls, and the default keeps the step whole
    mha = AttnShape(32, 2048, 1, 32, 32, 128)
    for lay_, shape in ((StarTrailLayout(32, 2, "team"), gqa), (ring, mha)):
        t_on, t_off, t_auto = (
            sum(startrail_times(lay_, cl, shape, None)) for cl in (on, off, base)
        )
        assert t_off <= t_on and t_auto == t_off
        assert t_off < t_on or lay_ is ring  # MHA on the ring placement: hidden by transfers
    with pytest.raises(SystemExit):
        cli.main(["--own-rows-first", "maybe"])


def test_overlap_whatif_script():
    """``scripts/overlap_whatif.py`` (the figures of docs/performance.md section 11): the
    split helps somewhere and hurts somewhere, the default rule is never more than 1%
    behind the faster setting, and the tail designs not built gain at most a few percent."""
    import re
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "scripts/overlap_whatif.py"], capture_output=True, text=True,
        timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lo, hi = map(float, re.search(r"on vs off: ([-+.\d]+)% .* to ([-+.\d]+)%", out.stdout).groups())
    assert lo < 0 < hi
    best, total, behind = re.search(
        r"faster setting in (\d+) of (\d+) cases; at most ([.\d]+)% behind", out.stdout
    ).groups()
    assert int(total) == 160 and int(best) >= 0.9 * 160 and float(behind) <= 1.0
    gains = re.findall(r"at G [=>] 1: ([-.\d]+)% to ([-.\d]+)%", out.stdout)
    assert len(gains) == 2 and all(-5 < float(a) <= float(b) < 5 for a, b in gains)
    # row halves at G = 1 gain a little; four head groups lose once their calls are charged
    assert 0 <= float(gains[0][0]) and float(gains[1][1]) < 0


# ---- autotune --------------------------------------------------------------------------
def test_autotune_picks_fastest_and_logs():
    cands = startrail_candidates(16)
    assert [c.name for c in cands] == [
        "ring",
        "startrail-C2-team",
        "startrail-C2-ring",
        "startrail-C4-team",
    ]
    fake = {
        "ring": [3.0, 3.2, 2.9],
        "startrail-C2-team": [1.0, 1.1, 5.0],
        "startrail-C2-ring": [1.5, 1.4, 1.6],
    }

    def run(c):
        if c.name == "startrail-C4-team":
            raise RuntimeError("CUDA out of memory")
        return fake[c.name]

    log: list[str] = []
    res = autotune(cands, run, log=log.append)
    assert res.best.name == "startrail-C2-team"  # median 1.1 beats 1.5 despite one slow outlier
    assert [t.candidate.name for t in res.trials] == [c.name for c in cands]
    assert res.trials[-1].median_s is None and "out of memory" in res.trials[-1].error
    assert log[-1] == "startrail autotune: chose startrail-C2-team" and len(log) == 5
    assert "* startrail-C2-team" in res.summary()
    # ties go to the earlier candidate; scalars are accepted
    assert autotune(cands[:2], lambda c: 1.0).best.name == "ring"
    with pytest.raises(RuntimeError, match="every candidate failed"):
        autotune(cands[:1], lambda c: (_ for _ in ()).throw(MemoryError("oom")))
    with pytest.raises(ValueError, match="at least one candidate"):
        autotune([], run)
    with pytest.raises(ValueError, match="need times >= 0"):
        autotune(cands[:1], lambda c: [])


def test_prediction_is_deterministic_and_sane():
    shape = AttnShape(4, 512, 1, 8, 8, 64, elem_bytes=4)
    cl = ClusterSpec("t", 4, 1, 1e9, 1e-5, 1e9, 1e9, 1e-5, 1e10, 2.5, 1e10, 1e-4, 1e10, False)
    a = predict(Strategy("startrail", 2), cl, shape)
    b = predict(Strategy("startrail", 2), cl, shape)
    assert a == b and a.attn_s == pytest.approx(a.attn_fwd_s + a.attn_bwd_s)
    assert a.attn_bwd_s > a.attn_fwd_s > 0
    _ = torch  # the shapes above mirror a CPU benchmark


def test_buffer_bytes_from_real_sizes():
    """All-gather-KV's elementwise work is on full-sequence buffers; counted by hand here."""
    p, s, h, d = 4, 8, 2, 16
    shape = AttnShape(p, s, 1, h, h, d, elem_bytes=4, acc_bytes=4, causal=False)
    u = s * h * d  # one local q, k or v tensor, elements
    full = p * 2 * u  # the gathered K,V
    fwd, bwd = buffer_bytes(Strategy("allgather"), shape)
    assert fwd == (4 * u + u) * 4  # stack k,v; zero the fp32 output (no cast: fp32 input)
    # stack; dq and dK/dV zeros; dq += g_q (s rows) and dK/dV += (P s rows); the
    # reduce-scatter's P-1 sums of a 2u chunk
    assert bwd == (4 * u + u + full + (u + 2 * p * u) * 3 + 3 * (p - 1) * 2 * u) * 4
    causal = AttnShape(p, s, 1, h, h, d, elem_bytes=4, acc_bytes=4)
    c_fwd, c_bwd = buffer_bytes(Strategy("allgather"), causal)
    assert c_fwd == fwd + 2 * full * 4  # the gathered K,V reordered into chunk order
    # Full-sequence buffers: all-gather's work per rank grows with P at a fixed local size,
    # StarTrail's (team buffers) does not beyond its ring steps.
    big = AttnShape(16, s, 1, h, h, d, elem_bytes=4, acc_bytes=4)
    assert buffer_bytes(Strategy("allgather"), big)[1] > 3 * c_bwd
    assert (
        buffer_bytes(Strategy("startrail", 2), big)[0]
        == buffer_bytes(
            Strategy("startrail", 2), AttnShape(4, s, 1, h, h, d, elem_bytes=4, acc_bytes=4)
        )[0]
    )
    # Without a memory bandwidth the work is not modelled; with one it adds bytes / mem_bw.
    cl = ClusterSpec("t", 4, 1, 1e9, 1e-5, 1e9, 1e9, 1e-5, 1e10, 2.5, 1e10, 1e-4, 1e10, False)
    base = predict(Strategy("allgather"), cl, causal)
    with_mem = predict(Strategy("allgather"), cl.with_(mem_bw=1e9), causal)
    assert with_mem.attn_s == pytest.approx(base.attn_s + (c_fwd + c_bwd) / 1e9)


# ---- the registry and purity ----------------------------------------------------------
def test_registry_declares_every_kind_once():
    from typing import get_args

    from startrail_megatron.planner import KINDS

    assert STRATEGY_KINDS == tuple(KINDS) == get_args(StrategyKind)
    assert all(spec.kind == kind for kind, spec in KINDS.items())
    # every kind is a candidate where it runs, in registry order, StarTrail's variants first
    kinds = [s.kind for s in candidate_strategies(16, 16, 16)]
    assert sorted(set(kinds), key=kinds.index) == list(STRATEGY_KINDS)
    assert [s.name for s in startrail_candidates(16)] == [
        s.name for s in candidate_strategies(16, 16, 16) if s.kind == "startrail"
    ]
    # the 2-D split: every U dividing P below P, StarTrail's variants over P / U
    split = [s.name for s in candidate_strategies(16, 16, 16) if s.kind == "split"]
    assert split == [
        "ring+ulysses2", "startrail-C2-team+ulysses2", "startrail-C2-ring+ulysses2",
        "ring+ulysses4", "startrail-C2-team+ulysses4", "ring+ulysses8",
    ]  # fmt: skip
    # U must divide the query heads, and U and the KV heads one another
    assert [s.name for s in candidate_strategies(16, 12, 3) if s.kind == "split"] == []
    assert [s.name for s in candidate_strategies(16, 12, 6) if s.kind == "split"] == split[:3]
    assert [s.name for s in candidate_strategies(16, 16, 2) if s.kind == "split"] == split
    labels = {s.name: s.placement_label for s in candidate_strategies(16, 16, 16)}
    assert labels["ring"] == labels["allgather"] == "-"
    assert labels["startrail-C2-ring"] == "ring"


PURE = [
    "accounting",
    "planner",
    "planner.batch",
    "planner.autotune",
    "planner.buffers",
    "planner.calibrate",
    "planner.cli",
    "planner.cluster",
    "planner.compute",
    "planner.links",
    "planner.memory",
    "planner.paper",
    "planner.placement",
    "planner.plan",
    "planner.prediction",
    "planner.shape",
    "planner.strategies",
    "planner.times",
    "schedule",
    "schedule.allgather",
    "schedule.batch",
    "schedule.blocks",
    "schedule.layout",
    "schedule.packing",
    "schedule.calls",
    "schedule.own_rows",
    "schedule.policies",
    "schedule.step",
    "schedule.windows",
]


def test_planner_and_accounting_import_no_torch():
    """The planner, the accounting and the block plan import no torch (so no
    torch.distributed): imported in a fresh interpreter with the package root bypassed
    (a stand-in module), so that only these modules' own imports count."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(st.__file__).parent
    code = f"""
import importlib, sys, types
pkg = types.ModuleType("startrail_megatron")
pkg.__path__ = [{str(root)!r}]
sys.modules["startrail_megatron"] = pkg
for name in {PURE!r}:
    importlib.import_module("startrail_megatron." + name)
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not bad, bad[:5]
import startrail_megatron.planner as planner
print(planner.predict.__module__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "startrail_megatron.planner.prediction"
    assert {p.stem for p in (root / "planner").glob("*.py")} - {"__init__", "__main__"} <= {
        n.removeprefix("planner.") for n in PURE
    }


# ---- packed documents: the cost model counts the per-document calls ---------------------------
def test_cost_model_counts_packed_documents():
    from startrail_megatron.planner.compute import startrail_work
    from startrail_megatron.schedule.packing import pack_lengths

    lengths = [24000, 320, 5600, 88, 32000, 2000]  # long enough for compute to dominate
    packed = pack_lengths(lengths, 8)
    dense = AttnShape(8, packed.s_local, 1, 32, 8, 128)
    shape = AttnShape(8, packed.s_local, 1, 32, 8, 128, packed=packed)
    h100 = CLUSTER_PRESETS["h100-ib"]
    for c in (1, 2):
        lay = st.StarTrailLayout(8, c)
        work = startrail_work(lay, True, packed.s_local, packed)
        pairs = sum(w[0][0] + w[0][1] for row in work for w in row)  # full + diagonal pairs
        # every needed pair once, plus the masked half of each diagonal tile it computes
        need = sum(n * (n + 1) // 2 for n in lengths)
        assert need <= pairs <= need * 1.05, (pairs, need)
        got, ref = (
            predict(Strategy("startrail", c), h100, shape),
            predict(Strategy("startrail", c), h100, dense),
        )
        # far fewer pairs than one sequence (at short lengths the per-document calls'
        # overhead wins instead: 6 documents of 1K tokens per rank predict slower)
        assert got.attn_s < 0.6 * ref.attn_s
        assert got.p2p_bytes == ref.p2p_bytes  # K,V still travel whole
    with pytest.raises(ValueError, match="packed is laid out for cp_size 8"):
        AttnShape(4, packed.s_local, 1, 32, 8, 128, packed=packed)


def test_cost_model_charges_varlen_kernels_per_grouped_call():
    """Short documents: one kernel call per document and block costs more overhead than
    the grouped (varlen / THD) calls of the same pairs."""
    from startrail_megatron.planner.compute import startrail_work
    from startrail_megatron.schedule import startrail_step_varlen
    from startrail_megatron.schedule.packing import pack_lengths

    packed = pack_lengths([8000, 4000, 2500, 900, 300, 100], 8)
    h100 = CLUSTER_PRESETS["h100-ib"]
    for c in (1, 2):
        lay = st.StarTrailLayout(8, c)
        per_doc = startrail_work(lay, True, packed.s_local, packed)
        grouped = startrail_work(lay, True, packed.s_local, packed, True)
        for step, (row_d, row_g) in enumerate(zip(per_doc, grouped)):
            for r, (wd, wg) in enumerate(zip(row_d, row_g)):
                assert wd[0] == wg[0] and wd[2] == wg[2]  # the same pairs and shapes
                assert wg[1] == len(startrail_step_varlen(lay, r, step, True, packed)) < wd[1]
        kw = dict(packed=packed)
        a = predict(
            Strategy("startrail", c), h100, AttnShape(8, packed.s_local, 1, 32, 8, 128, **kw)
        )
        v = predict(
            Strategy("startrail", c), h100,
            AttnShape(8, packed.s_local, 1, 32, 8, 128, varlen=True, **kw),
        )  # fmt: skip
        assert v.attn_s < a.attn_s and v.p2p_bytes == a.p2p_bytes
    with pytest.raises(ValueError, match="varlen=True describes packed documents"):
        AttnShape(8, packed.s_local, 1, 32, 8, 128, varlen=True)


def test_packed_balance_script():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "scripts/packed_balance.py",
            "--docs",
            "12",
            "--tokens",
            "4096",
            "--cp-size",
            "4",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.split()[1:2] == ["packed"]]
    assert [r[0] for r in rows] == ["1", "2"]
    for r in rows:
        assert 1.0 <= float(r[3]) < 1.1  # max/mean kernel work: balanced
        assert int(r[6]) < int(r[5])  # grouped varlen calls: fewer than per document


def test_cost_model_counts_the_window_pairs():
    """AttnShape(window=): StarTrail's compute is the band pairs of the windowed calls (the
    window's pairs exactly), its bytes those of the steps it runs (idle sub-ring steps
    skipped: fewer at C = 1, W = S/16); a window that masks nothing changes nothing; the
    script prints the table of docs/performance.md section 9."""
    import subprocess
    import sys

    from startrail_megatron.accounting import startrail_comm_bytes
    from startrail_megatron.planner.compute import startrail_work
    from startrail_megatron.schedule import startrail_active_steps

    # 16K tokens: at 4K a window's more calls (31 against C = 2's 22, its one step's doubled
    # by the head groups) outweigh its pairs on the H100 preset, as they would on the GPU
    p, s_local = 8, 2048
    n = p * s_local
    lay = st.StarTrailLayout(p, 1)
    for w in (n // 16, n // 4):
        work = startrail_work(lay, True, s_local, None, False, (w - 1, None))
        pairs = sum(x[0][0] + x[0][1] for row in work for x in row)
        assert pairs == sum(min(i + 1, w) for i in range(n))
    h100 = CLUSTER_PRESETS["h100-ib"]
    dense = AttnShape(p, s_local, 1, 32, 8, 128)
    for c in (1, 2):
        full = predict(Strategy("startrail", c), h100, dense)
        win_shape = AttnShape(p, s_local, 1, 32, 8, 128, window=(n // 16 - 1, 0))
        win = predict(Strategy("startrail", c), h100, win_shape)
        same = predict(Strategy("startrail", c), h100, AttnShape(p, s_local, 1, 32, 8, 128,
                                                                 window=(-1, 0)))  # fmt: skip
        lay = Strategy("startrail", c).layout(p)
        active = startrail_active_steps(lay, True, s_local, (n // 16 - 1, None))
        acc = [startrail_comm_bytes(lay, r, win_shape.local, active) for r in range(p)]
        assert win.attn_s < full.attn_s
        assert win.p2p_bytes == max(b["fwd_p2p"] + b["bwd_p2p"] for b in acc)
        if c == 1:  # 3 of the 8 ring steps run (0, 1, 7): fewer bytes
            assert active == ((0, 1, 7),) and win.p2p_bytes < full.p2p_bytes
        assert same == full
    out = subprocess.run(
        [sys.executable, "scripts/window_cost.py", "--seq", "4096", "--cp-size", "4"],
        capture_output=True, text=True, timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["4096"] * 2 + ["1024"] * 2 + ["256"] * 2
    for r in rows[2:]:
        assert float(r[4]) < 1.0  # fewer pairs than full causal


def test_dit_1b_preset_is_full_attention_and_plans_the_papers_dit_setting():
    """DiT-1B (24 layers, hidden 1536, 24 heads, adaLN-Zero: ~1.0e9 parameters), full
    attention, on the paper's DiT cluster (32 A100s, 8 per node, 100 Gb/s Ethernet)."""
    m = MODEL_PRESETS["dit-1b"]
    assert (m.layers, m.hidden, m.heads, m.causal, m.adaln_zero) == (24, 1536, 24, False, True)
    assert 0.95e9 < m.params < 1.1e9
    shape = AttnShape.for_model(m, 128 * 1024, 32)
    assert shape.causal is False
    cluster = CLUSTER_PRESETS["a100-eth"].with_(num_nodes=4)
    pl = plan(cluster, m, 128 * 1024, 32)
    rows = {r.strategy: r for r in pl.rows}
    assert {"ring", "startrail-C2-team", "startrail-C4-team", "allgather"} <= set(rows)
    ring = rows["ring"].p2p_bytes  # StarTrail's P2P: about 1/C of ring's
    assert 0.45 * ring < rows["startrail-C2-team"].p2p_bytes < 0.55 * ring
    assert 0.2 * ring < rows["startrail-C4-team"].p2p_bytes < 0.3 * ring


def test_plan_with_a_window_charges_what_each_strategy_computes_and_sends():
    """``plan(window=)`` / ``startrail-plan --window``: every strategy is charged the window's
    pairs (the peers too, in their own calls: the same total over the ranks as the window
    holds), StarTrail the sub-ring steps it runs (ring at W = S/16: fewer bytes than full
    causal), and a bad window is a ValueError naming it."""
    from startrail_megatron.planner.cli import main as plan_main
    from startrail_megatron.planner.compute import (
        allgather_call_shapes,
        call_work,
        ulysses_call_shapes,
    )

    h100, gpt = CLUSTER_PRESETS["h100-ib"], MODEL_PRESETS["gpt-7b"]
    full = {r.strategy: r for r in plan(h100, gpt, 65536, 16).rows}
    win = {r.strategy: r for r in plan(h100, gpt, 65536, 16, window=4096).rows}
    assert win["ring"].p2p_bytes < full["ring"].p2p_bytes
    for name in ("ring", "startrail-C2-team", "allgather", "ulysses"):
        assert win[name].attn_s < full[name].attn_s, name
    assert win["allgather"].collective_bytes == full["allgather"].collective_bytes
    for p, s, causal, w in ((4, 32, True, (15, 0)), (4, 32, False, (7, 7)), (8, 16, True, (3, 0))):
        shape = AttnShape(p, s, 1, 4, 4, 8, causal=causal, window=w)
        n = p * s
        want = sum(1 for i in range(n) for j in range(n)
                   if i - w[0] <= j <= i + w[1] and (not causal or j <= i))  # fmt: skip
        got = sum(call_work(allgather_call_shapes(r, shape))[0][0] for r in range(p))
        assert got == want == call_work(ulysses_call_shapes(shape))[0][0]
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match=f"window={bad!r} must be a number of tokens"):
            plan(h100, gpt, 65536, 16, window=bad)
    with pytest.raises(ValueError, match="causal sliding window; model 'dit-1b' is not causal"):
        plan(h100, MODEL_PRESETS["dit-1b"], 65536, 16, window=4096)
    assert plan_main(["--seq-len", "64K", "--cp-size", "16", "--window", "4K", "--json"]) == 0


def test_planner_step_memory_matches_the_recorded_benchmark():
    """The planner's bytes per local token of the whole step (``step_bytes_per_token``)
    against the slopes ``startrail-bench --workload memory`` measured (the run recorded in
    docs/memory_benchmark.json, docs/performance.md section 14): within 15 % for every
    configuration, each feature alone, all together, and at the larger vocabulary; and the
    transformer layers' phase alone."""
    from startrail_megatron.bench.step_memory import planner_slopes

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "memory_benchmark.json")
    with open(path) as f:
        report = json.load(f)
    cmp = planner_slopes(report)
    assert {"plain", "all", "tiled-loss", "tiled-mlp", "recompute"} <= set(cmp)
    bad = {k: round(v["error"], 3) for k, v in cmp.items() if abs(v["error"]) > 0.15}
    assert not bad, bad
    # the transformer layers' phase alone too (its forward and backward: the recomputed
    # layer's MLP backward under full recompute, the attention's buffers)
    layers = {
        k: v["planner"]["layers"] / report["results"][k]["decoder"]["slope_bytes_per_token"] - 1
        for k, v in cmp.items()
    }
    bad = {k: round(e, 3) for k, e in layers.items() if abs(e) > 0.15}
    assert not bad, bad


def test_node_map_is_never_predicted_slower_than_the_named_placements():
    """``planner.placement.node_map`` (issue 48's search): on every topology its map is a
    permutation of the CP ranks predicted no slower than ``team`` or ``ring``, and strictly
    faster where the sub-ring length does not fit the node (3 nodes x 4, P = 12, C = 2,
    G = 3, 2 GB/s between nodes); on one node it is the team placement's map."""
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS, MODEL_PRESETS
    from startrail_megatron.planner.placement import map_cost, node_map
    from startrail_megatron.planner.shape import AttnShape

    base = CLUSTER_PRESETS["h100-ib"].with_(inter_bw=2e9, inter_bw_per_gpu=2e9)
    model = next(iter(MODEL_PRESETS.values()))
    for nodes, per, p in [(3, 4, 12), (4, 2, 8), (2, 4, 8), (6, 2, 12), (1, 8, 8)]:
        cl = base.with_(num_nodes=nodes, gpus_per_node=per)
        shape = AttnShape.for_model(model, 2 * p * 512, p)
        m, cost = node_map(cl, shape, 2)
        assert sorted(m) == list(range(p))
        named = {pl: map_cost(cl, shape, 2, pl) for pl in ("team", "ring")}
        assert cost <= min(named.values()) * (1 + 1e-12), (nodes, per, cost, named)
        assert cost == pytest.approx(map_cost(cl, shape, 2, m))
        if (nodes, per) == (3, 4):
            assert cost < 0.9 * min(named.values()), (cost, named)
        if nodes == 1:
            assert m == tuple(range(p))


def test_node_map_tries_every_sharing_of_whole_teams_among_few_nodes():
    """``node_map``'s whole-team starts: on 3 nodes x 4 of ``h100-ib`` (P = 12, C = 2,
    4,096 tokens per rank) the swaps alone stop at the team placement's map (22.7 ms);
    every team on one node with one team of each team group per node is 3 % faster, and
    that sharing is what the search returns: its cost is the least of all 15 ways to share
    the 6 teams among the nodes (fails without ``_team_starts``). Also: the 15 and 105
    ways of 3 x 4 and 4 x 4 are all distinct; 3 x 8 (5,775 ways) and uneven nodes take none."""
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS
    from startrail_megatron.planner.placement import (
        AUTO_SHAPE,
        _team_starts,
        map_cost,
        node_assignments,
        node_map,
    )  # fmt: skip
    from startrail_megatron.planner.shape import AttnShape

    cl = CLUSTER_PRESETS["h100-ib"].with_(gpus_per_node=4, num_nodes=3)
    shape = AttnShape(cp_size=12, **AUTO_SHAPE)
    starts = _team_starts(cl, 12, 2)
    assert len(starts) == len(set(starts)) == 15
    costs = [map_cost(cl, shape, 2, m) for m in starts]
    m, cost = node_map(cl, shape, 2)
    assert cost == pytest.approx(min(costs)), (cost, min(costs))
    team = map_cost(cl, shape, 2, "team")
    assert cost < 0.98 * team, (cost, team)
    nodes = [[cl.node(r) for r in m[t * 2 : t * 2 + 2]] for t in range(6)]
    assert all(a == b for a, b in nodes), m  # whole teams
    assert sorted(n for n, _ in nodes[:3]) == [0, 1, 2], m  # team group 0: a team per node
    ways = list(node_assignments(8, 4, 2))
    assert len(ways) == len(set(ways)) == 105
    assert _team_starts(cl.with_(gpus_per_node=8), 24, 2) == []  # 5,775 ways
    uneven = cl.with_(num_nodes=4, rank_nodes=(0,) * 4 + (1,) * 4 + (2,) * 2 + (3,) * 2)
    assert _team_starts(uneven, 12, 2) == []


def test_node_map_packs_whole_sub_rings_into_nodes():
    """``node_map``'s sub-ring packings (``_subring_starts``): on 3 nodes x 8 at 2 GB/s
    between nodes (P = 24, C = 2, G = 6: no node holds a whole number of sub-rings) the
    map keeps three sub-rings each inside one node and lays the fourth over all three in
    pieces, predicted 0.74 of the ``ring`` placement's time, which the swaps alone never
    left (fails without the packings: the ring placement's 1.28 ms is returned).
    24 orders x 6 node orders, no duplicate; no packing where a sub-ring exceeds a node."""
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS, MODEL_PRESETS
    from startrail_megatron.planner.placement import _subring_starts, map_cost, node_map
    from startrail_megatron.planner.shape import AttnShape
    from startrail_megatron.schedule.layout import StarTrailLayout

    base = CLUSTER_PRESETS["h100-ib"].with_(inter_bw=2e9, inter_bw_per_gpu=2e9)
    cl = base.with_(num_nodes=3, gpus_per_node=8)
    shape = AttnShape.for_model(next(iter(MODEL_PRESETS.values())), 2 * 24 * 512, 24)
    starts = _subring_starts(cl, 24, 2)
    assert len(starts) == len(set(starts)) == 144
    assert all(sorted(m) == list(range(24)) for m in starts)
    m, cost = node_map(cl, shape, 2, max_evals=20)  # the packing is a start: few swaps
    ring = map_cost(cl, shape, 2, "ring")
    assert cost < 0.8 * ring, (cost, ring)
    lay = StarTrailLayout(24, 2, m)
    pieces = sorted(len({r // 8 for r in ranks}) for ranks in lay.all_subring_ranks())
    assert pieces == [1, 1, 1, 3], (m, pieces)
    assert _subring_starts(cl.with_(num_nodes=6, gpus_per_node=4), 24, 2) == []  # G = 6 > 4


def test_node_map_swaps_ranks_inside_a_node_last():
    """``node_map``'s last phase: swaps of two ranks of one node change no link but which
    chunks of the sequence form each team, and so each step's causal work. On the model of
    the emulated 3 x 8 run at h100-ib's ratio (its probe's links, timed kernels at 20.8
    GFLOP/s; docs/performance.md section 15) the map the cross-node search returns gains
    from such a swap; the map ``node_map`` returns gains from none (fails without the phase)
    and is predicted under 0.99 of the best packing of whole sub-rings."""
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS
    from startrail_megatron.planner.placement import _subring_starts, map_cost, node_map
    from startrail_megatron.planner.shape import AttnShape

    cl = CLUSTER_PRESETS["h100-ib"].with_(
        name="emulated 3x8 at 200 Mbit/s", gpus_per_node=8, num_nodes=3, intra_bw=3.69e8,
        intra_latency=0.0, inter_bw=2.35e7, inter_bw_per_gpu=2.35e7, inter_latency=0.0,
        attn_flops=2.08e10, attn_bwd_ratio=2.5, matmul_flops=2.2e10, kernel_overhead=0.0103,
        overlap=True, all_to_all_inter_bw=2.35e7, causal_tile_waste=0.0, mem_bw=5.37e8,
        host_cores=2, host_cpu_intra=7.2e-10, host_cpu_inter=8.05e-9,
    )  # fmt: skip
    shape = AttnShape(24, s_local=400, batch=1, heads_q=24, heads_kv=24, head_dim=16,
                      elem_bytes=4, acc_bytes=4, causal=True)  # fmt: skip

    def inside_gain(m) -> bool:
        base = map_cost(cl, shape, 2, m)
        for i in range(24):
            for j in range(i + 1, 24):
                if cl.node(m[i]) == cl.node(m[j]):
                    x = list(m)
                    x[i], x[j] = x[j], x[i]
                    if map_cost(cl, shape, 2, tuple(x)) < base * (1 - 1e-9):
                        return True
        return False

    packing = min(_subring_starts(cl, 24, 2), key=lambda m: map_cost(cl, shape, 2, m))
    assert inside_gain(packing)
    m, cost = node_map(cl, shape, 2, max_evals=200)
    assert not inside_gain(m), m
    assert cost < 0.99 * map_cost(cl, shape, 2, packing)


def test_exhaustive_map_prices_every_assignment_and_bounds_the_search(capsys):
    """``exhaustive_map`` (the check of ``node_map``'s search): it prices each assignment of
    the logical ranks to nodes once (105 on 4 x 2, 462 on 2 x 6: 8! / (2!^4 4!) and
    12! / (6!^2 2!)), none is faster than its answer, and the search finds a map at least as
    fast (it also orders the ranks inside a node, which the enumeration does not); uneven nodes and too many assignments refused by name. The script
    prints the row for a preset; its annealing returns a permutation no slower than its
    start, the same on every run."""
    from common import load_script

    from startrail_megatron.planner.cluster import CLUSTER_PRESETS
    from startrail_megatron.planner.placement import (
        AUTO_SHAPE,
        exhaustive_map,
        map_cost,
        node_assignments,
        node_map,
    )  # fmt: skip
    from startrail_megatron.planner.shape import AttnShape

    for nodes, per, ways in [(4, 2, 105), (2, 6, 462)]:
        cl = CLUSTER_PRESETS["h100-ib"].with_(num_nodes=nodes, gpus_per_node=per)
        shape = AttnShape(nodes * per, **AUTO_SHAPE)
        m, best, count = exhaustive_map(cl, shape, 2)
        assert count == ways == len(set(node_assignments(nodes * per, nodes, per)))
        assert sorted(m) == list(range(nodes * per)) and best == map_cost(cl, shape, 2, m)
        for assignment in list(node_assignments(nodes * per, nodes, per))[:: ways // 20]:
            other = [0] * (nodes * per)
            fill = [0] * nodes
            for logical, node in enumerate(assignment):
                other[logical] = node * per + fill[node]
                fill[node] += 1
            assert best <= map_cost(cl, shape, 2, tuple(other)) * (1 + 1e-12)
        assert node_map(cl, shape, 2)[1] <= best * (1 + 1e-9)
    cl = CLUSTER_PRESETS["h100-ib"].with_(num_nodes=3, gpus_per_node=8)
    with pytest.raises(ValueError, match="max_assignments=20000"):
        exhaustive_map(cl, AttnShape(24, **AUTO_SHAPE), 2)
    uneven = CLUSTER_PRESETS["h100-ib"].with_(
        num_nodes=3, gpus_per_node=4, rank_nodes=(0,) * 4 + (1,) * 2 + (2,) * 2
    )
    with pytest.raises(ValueError, match="as many CP ranks"):
        exhaustive_map(uneven, AttnShape(8, **AUTO_SHAPE), 2)
    script = load_script("placement_exhaustive")
    script.main(["--preset", "h100-ib", "--topology", "4x2"])
    out = capsys.readouterr().out
    assert "| h100-ib 4 x 2 | 105 (" in out, out
    cl = CLUSTER_PRESETS["h100-ib"].with_(num_nodes=4, gpus_per_node=2)
    shape = AttnShape(8, **AUTO_SHAPE)
    start = tuple(range(8))
    m, cost = script.anneal(cl, shape, 2, start, 60)  # where enumerating is too costly
    assert sorted(m) == list(range(8)) and cost == map_cost(cl, shape, 2, m)
    assert cost <= map_cost(cl, shape, 2, start)
    assert script.anneal(cl, shape, 2, start, 60) == (m, cost)  # seeded


def test_plan_searches_maps_and_draws_the_chosen_one():
    """``startrail-plan`` (issue 48): where the sub-ring length does not fit the node (3 x 4
    A100 nodes, P = 12, C = 2), the computed map is a row of its own, predicted faster than
    both named placements, and the table draws it as nodes and ranks; on one node, or with
    ``map_search=False``, no map row."""
    from startrail_megatron.planner.cli import format_plan
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS, MODEL_PRESETS
    from startrail_megatron.planner.plan import plan
    from startrail_megatron.schedule.layout import StarTrailLayout

    cl = CLUSTER_PRESETS["a100-eth"].with_(gpus_per_node=4, num_nodes=3)
    model = MODEL_PRESETS["llama3-8b"]
    pl = plan(cl, model, 96 * 1024, 12)
    rows = {r.strategy: r for r in pl.rows}
    assert set(pl.maps) == {"startrail-C2-map"}, pl.maps
    m = pl.maps["startrail-C2-map"]
    assert sorted(m) == list(range(12))
    named = min(rows[f"startrail-C2-{p}"].attn_s for p in ("team", "ring"))
    assert rows["startrail-C2-map"].attn_s < 0.97 * named
    text = format_plan(pl)
    assert "placement map of startrail-C2-map" in text and text.count("\nnode ") == 3, text
    for r in range(12):  # every CP rank drawn once, with its logical coordinate
        lay = StarTrailLayout(12, 2, m)
        t, a = lay.coord(r)
        assert f"r{r}=t{t}.{a}/" in text
    assert not plan(cl, model, 96 * 1024, 12, map_search=False).maps
    assert not plan(cl.with_(gpus_per_node=16, num_nodes=1), model, 96 * 1024, 12).maps
