"""DeepSpeed integration on CPU gloo ranks: a tiny Llama trains with StarTrail under
ZeRO 1/2/3 and matches a single-rank run without sequence parallelism (fp32, 1e-5)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os

import pytest
import torch
from common import AllocationCap, own_rows_first_env
from ds_common import (
    CLIP,
    LR,
    REPO,
    SEQ,
    STEPS,
    VOCAB,
    global_batches,
    rank_env,
    reference_run,
    tiny_llama,
)
from ds_common import ds_config as make_cfg
from harness import run_ranks

import startrail_megatron.deepspeed as sds  # after ds_common, which sets DS_ACCELERATOR
from startrail_megatron.accounting import LocalShape, startrail_comm_bytes, startrail_comm_calls
from startrail_megatron.schedule import tail_head_groups
from startrail_megatron.schedule.layout import StarTrailLayout
from startrail_megatron.schedule.packing import pack_lengths

REL = 1e-5


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _full_params(engine, stage: int) -> dict:
    import deepspeed

    params = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {k: v.detach().clone() for k, v in params}
    return {k: v.detach().clone() for k, v in params}


def _teardown(engine) -> None:
    """Drop the engine before anything else (its groups and hooks hold the ranks' state);
    reset DeepSpeed's hpZ global."""
    from deepspeed.utils import groups as ds_groups

    del engine
    gc.collect()
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None


def _train(
    rank: int,
    world: int,
    cfg: dict,
    use_adapter: bool = False,
    as_tuple: bool = False,
    tied: bool = False,
):
    rank_env(rank, world)
    st = cfg["startrail"]
    p = st["sequence_parallel_size"]
    dp, d = world // p, rank // p
    model = tiny_llama(tied=tied)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = sds.initialize(model=model, optimizer=opt, config=cfg)
    mpu = engine.startrail_mpu
    assert (mpu.data_parallel_rank, mpu.data_parallel_size) == (d, dp)
    assert mpu.get_sequence_parallel_world_size() == p
    assert mpu.get_sequence_data_parallel_world_size() == world
    assert engine.sequence_parallel_size == p and engine.seq_dp_world_size == world
    info = {}
    from deepspeed.utils import groups as ds_groups

    if ds_groups._get_zero_param_intra_parallel_group() is not None:
        lay, cp = mpu.startrail.layout, mpu.startrail.cp_rank
        team = lay.team_ranks(lay.coord(cp)[0])
        info["hpz"] = list(ds_groups._get_zero_param_intra_parallel_group_ranks())
        info["team"] = [d * p + r for r in team]
        info["stage3_hpz"] = engine.optimizer.zero_hpz_partition_size
    gas = cfg["gradient_accumulation_steps"]
    batches = [  # this replica's micro-batches, gas per step: sequence m * dp + d
        (ids[j : j + 1], lab[j : j + 1])
        for ids, lab in global_batches(dp * gas)
        for j in range(d, dp * gas, dp)
    ]
    if use_adapter:
        engine.startrail_handle.shard_inputs = False
        feed = sds.StarTrailDataLoaderAdapter(
            [{"input_ids": i, "labels": lab} for i, lab in batches], mpu
        )
    else:
        feed = [{"input_ids": i, "labels": lab} for i, lab in batches]
    micro_losses = []
    for batch in feed:
        if as_tuple:  # return_dict=False: (loss, logits, ...)
            loss = engine(**batch, return_dict=False)[0]
        else:
            loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()  # DeepSpeed updates at the last micro-batch of each step
        micro_losses.append(loss.float().item())
    # a step's loss: the mean over its micro-batches (DeepSpeed scales each by 1/gas)
    losses = [sum(micro_losses[i : i + gas]) / gas for i in range(0, len(micro_losses), gas)]
    handle = engine.startrail_handle
    info.update(_proof(handle.ledger, handle.local_lengths, model, mpu))
    info["attention_calls"] = len(micro_losses) * 2  # micro-batches x layers
    params = _full_params(engine, cfg["zero_optimization"]["stage"])
    _teardown(engine)
    return losses, params, info


def _proof(ledger, local_lengths, model, mpu) -> dict:
    """What shows StarTrail ran on this rank: its transfers, the lengths its attention saw,
    the attention implementation in use, and where the rank sits in the layout."""
    return {
        "ledger": ledger.summary(),
        "local_lengths": sorted(local_lengths),
        "attn": model.config._attn_implementation,
        "layout": (mpu.startrail.cp_size, mpu.startrail.team_size, mpu.startrail.layout.placement),
        "cp_rank": mpu.startrail.cp_rank,
        "elem_bytes": next(model.parameters()).element_size(),
        "head_chunks": mpu.config.attention_head_chunks or 1,
    }


def _check_startrail_ran(info: dict) -> None:
    """StarTrail's attention ran on every layer of every step: each rank saw S/P tokens, the
    model used the "startrail" implementation, and the ledger holds exactly the bytes and
    calls the accounting gives for this layout (tiny Llama: 2 layers, 4 q / 2 KV heads of
    8, one sequence per micro-batch)."""
    p, c, placement = info["layout"]
    assert info["attn"] == "startrail", info["attn"]
    assert info["local_lengths"] == [SEQ // p], info["local_lengths"]
    lay = StarTrailLayout(p, c, placement)
    shape = LocalShape(SEQ // p, 1, 4, 2, 8, elem_bytes=info["elem_bytes"], acc_bytes=4)
    n = info["attention_calls"]
    want = startrail_comm_bytes(lay, info["cp_rank"], shape)
    hc = info.get("head_chunks", 1)  # each chunk: the same transfers on 1/hc of the heads
    tail = len(tail_head_groups(lay, 4 // hc, 2 // hc, False))  # the last step's head groups
    sends = lay.p2p_sends(info["cp_rank"], backward=True)
    calls = startrail_comm_calls(c, sends, tail, head_chunks=hc)
    got = info["ledger"]
    for ph in ("fwd", "bwd"):
        for kind in ("p2p", "collective"):
            assert got[f"{ph}_{kind}_bytes"] == n * want[f"{ph}_{kind}"], (ph, kind, got)
            assert got[f"{ph}_{kind}_calls"] == n * calls[f"{ph}_{kind}"], (ph, kind, got)
    assert got["fwd_p2p_bytes"] + got["fwd_collective_bytes"] > 0  # P = 4 always sends


_REF: dict = {}


def _reference(dp: int):
    if dp not in _REF:
        _REF[dp] = reference_run(dp)
    return _REF[dp]


def _check(results, world: int, p: int, ref=None, tol: float = REL, param_tol: float | None = None):
    """Every replica's losses (averaged: the global batch's) and every rank's final
    parameters against ``ref`` (default: the one-rank fp32 run without DeepSpeed), and the
    proof that StarTrail ran on every rank."""
    dp = world // p
    ref_losses, ref_params = ref if ref is not None else _reference(dp)
    assert all(len(res[0]) == len(ref_losses) for res in results)
    for step in range(len(ref_losses)):
        replica = [results[d * p][0][step] for d in range(dp)]
        for d in range(dp):  # every rank of a replica reports the replica's loss
            assert all(results[d * p + r][0][step] == replica[d] for r in range(p))
        got = sum(replica) / dp
        assert abs(got - ref_losses[step]) <= tol * abs(ref_losses[step]), (step, got, ref_losses)
    for rank, (_, params, info) in enumerate(results):
        _check_startrail_ran(info)
        assert params.keys() == ref_params.keys()
        worst = max(_rel(params[k].float(), ref_params[k].float()) for k in ref_params)
        assert worst <= (param_tol or tol), (rank, worst)
    # Training moved the parameters far beyond the tolerance (the check can fail).
    init = dict(tiny_llama().named_parameters())
    moved = max(_rel(ref_params[k].float(), init[k].detach()) for k in ref_params)
    assert moved > max(1e3 * REL, 10 * (param_tol or tol)), moved


def _st(p: int, c: int, **kw) -> dict:
    return {"enabled": True, "sequence_parallel_size": p, "team_size": c, **kw}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("c", [2, 1])
def test_zero_stages_match_single_rank_p4(stage, c):
    cfg = make_cfg(stage, dp=1, startrail=_st(4, c))
    _check(run_ranks(4, _train, cfg), world=4, p=4)


def test_gradient_accumulation_zero2():
    """2 micro-batches per step: the step's gradient is the mean over both sequences."""
    cfg = make_cfg(2, dp=1, startrail=_st(4, 2))
    cfg.update(gradient_accumulation_steps=2, train_batch_size=2)
    _check(run_ranks(4, _train, cfg), world=4, p=4, ref=_reference(2))


def _train_own_rows_first(rank, world, cfg, env):
    """``_train`` with ``STARTRAIL_OWN_ROWS_FIRST=env`` (None: unset); also how many
    calls the first steps' splits cut off for the rank's own rows."""
    with own_rows_first_env(env) as made:
        return (*_train(rank, world, cfg), sum(made))


@pytest.mark.parametrize("key, env, split", [("on", None, True), ("off", "on", False)])
def test_own_rows_first_key(key, env, split):
    """``startrail.own_rows_first`` reaches every attention call (over the environment
    variable): the same training as one rank, own-row calls made exactly when it says on."""
    cfg = make_cfg(1, dp=1, startrail=_st(4, 2, own_rows_first=key))
    res = run_ranks(4, _train_own_rows_first, cfg, env)
    _check([r[:3] for r in res], world=4, p=4)
    assert all((r[3] > 0) == split for r in res), [r[3] for r in res]


def _train_one_rank(rank, world, cfg):
    """The same DeepSpeed config on one rank without StarTrail: the bf16 reference."""
    rank_env(rank, world)
    model = tiny_llama()
    engine, _, _, _ = sds.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg
    )
    losses = []
    for ids, lab in global_batches(1):
        loss = engine(input_ids=ids, labels=lab).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    params = _full_params(engine, cfg["zero_optimization"]["stage"])
    _teardown(engine)
    return losses, params


# bf16 against one-rank bf16 DeepSpeed (bf16 model, fp32 master weights in both): the runs
# differ by bf16 rounding in another summation order. Measured (ZeRO 1 and 2): losses 5.9e-5,
# parameters 7.0e-3 of each tensor's largest entry (a bf16 step of it: 2^-8 = 3.9e-3); the
# one-rank bf16 run is itself 4.8e-5 / 5.4e-3 from fp32. Bounds with a 2-8x margin:
BF16_LOSS_TOL, BF16_PARAM_TOL = 5e-4, 1.6e-2


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_matches_one_rank_bf16(stage):
    cfg = make_cfg(stage, dp=1, startrail=_st(4, 2))
    cfg["bf16"] = {"enabled": True}
    plain = {k: v for k, v in cfg.items() if k != "startrail"}
    ref = run_ranks(1, _train_one_rank, plain)[0]
    results = run_ranks(4, _train, cfg)
    assert all(info["elem_bytes"] == 2 for _, _, info in results)  # the model ran in bf16
    _check(results, world=4, p=4, ref=ref, tol=BF16_LOSS_TOL, param_tol=BF16_PARAM_TOL)


def test_tuple_outputs_zero3():
    cfg = make_cfg(3, dp=1, startrail=_st(4, 2))
    _check(run_ranks(4, _train, cfg, False, True), world=4, p=4)


def test_dataloader_adapter_path():
    cfg = make_cfg(2, dp=1, startrail=_st(4, 2, placement="ring"))
    _check(run_ranks(4, _train, cfg, True), world=4, p=4)


def _train_on_two_hosts(rank: int, world: int, cfg: dict):
    """``_train`` with this rank on emulated host ``rank % 2`` (the ranks alternate)."""
    import socket

    real = socket.gethostname
    socket.gethostname = lambda: f"host{rank % 2}"
    try:
        return _train(rank, world, cfg)
    finally:
        socket.gethostname = real


def test_placement_auto_on_two_hosts():
    """``"placement": "auto"`` on ranks alternating between two emulated hosts: every rank
    runs the map the planner computes for those nodes (not a named placement), and the
    losses and parameters match one rank."""
    from startrail_megatron.planner.placement import auto_map

    cfg = make_cfg(2, dp=1, startrail=_st(4, 2, placement="auto"))
    results = run_ranks(4, _train_on_two_hosts, cfg)
    want = auto_map((0, 1, 0, 1), 2)
    assert want != tuple(range(4))
    assert all(info["layout"][2] == want for _, _, info in results), results[0][2]["layout"]
    _check(results, world=4, p=4)


# ---- the launcher: an unmodified DeepSpeed script gets StarTrail ----------------------------


def _launch(rank: int, world: int, cfg_path: str, out: str):
    import deepspeed

    from startrail_megatron.deepspeed import internals, launch, patch

    rank_env(rank, world)
    script = os.path.join(REPO, "scripts", "train_tiny_llama.py")
    launch.main([script, "--deepspeed_config", cfg_path, "--seq", str(SEQ), "--out", out])
    restored = deepspeed.initialize is internals.original_initialize and not patch.is_patched()
    gc.collect()
    with open(f"{out}.{rank}") as f:
        return json.load(f), restored


def test_launcher_runs_unmodified_script(tmp_path):
    cfg = make_cfg(2, dp=1, startrail=_st(4, 2))
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text(json.dumps(cfg))
    results = run_ranks(4, _launch, str(cfg_path), str(tmp_path / "out"))
    ref_losses, _ = _reference(1)
    for res, restored in results:
        assert restored, "the deepspeed.initialize patch was not undone"
        assert res["startrail"], "the script's deepspeed.initialize did not go through StarTrail"
        _check_startrail_ran(res["proof"])
        assert len(res["losses"]) == len(ref_losses)
        for got, ref in zip(res["losses"], ref_losses):
            assert abs(got - ref) <= REL * abs(ref), (res["losses"], ref_losses)


# ---- invalid sections fail before training, naming the key --------------------------------


@pytest.mark.parametrize(
    "section, zero, match",
    [
        (
            _st(4, 3),
            {},
            r"startrail\.team_size=3 does not fit .*allowed team_size values: \[1, 2\]",
        ),
        ({**_st(4, 2), "teamsize": 2}, {}, r"startrail\.teamsize is not a known key"),
        (
            {**_st(4, 2), "dynamic_context_parallel": True},
            {},
            r"startrail\.dynamic_context_parallel is not supported on the DeepSpeed path: .*"
            r"set startrail\.hybrid_context_parallel=true",
        ),
        (
            _st(4, 2, hybrid_context_parallel=True, placement="ring"),
            {},
            r"startrail\.hybrid_context_parallel runs each sub-group with the team placement.*"
            r"placement='ring'",
        ),
        (
            _st(4, 1, hybrid_context_parallel=True, ulysses_size=2),
            {},
            r"startrail\.hybrid_context_parallel .*startrail\.ulysses_size=2",
        ),
        (
            _st(4, 2, hybrid_context_parallel=True, batch_cluster="h200-nowhere"),
            {},
            r"startrail\.batch_cluster='h200-nowhere': neither a preset \(\['a100-eth'",
        ),
        (
            _st(4, 2, hybrid_context_parallel=True, tiled_mlp=64),
            {"stage": 3},
            r"startrail\.hybrid_context_parallel with startrail\.tiled_mlp under ZeRO-3",
        ),
        (
            _st(4, 2, max_tokens_per_rank=64),
            {},
            r"startrail\.max_tokens_per_rank applies with startrail\.hybrid_context_parallel",
        ),
        (
            _st(4, 2, hybrid_context_parallel=True, max_tokens_per_rank=1),
            {},
            r"startrail\.max_tokens_per_rank=1: .*greater than or equal to 2",
        ),
        (_st(4, "2"), {}, r"startrail\.team_size='2'.*valid integer"),
        ({**_st(4, 2), "enabled": "yes"}, {}, r"startrail\.enabled='yes'"),
        (
            {**_st(4, 2), "placement": "node"},
            {},
            r"startrail\.placement='node'.*'team', 'ring', 'auto'",
        ),
        ({**_st(4, 2), "zero_mapping": "hpz"}, {}, r"startrail\.zero_mapping='hpz'.*hpz_team"),
        (
            {**_st(4, 2), "own_rows_first": True},
            {},
            r"startrail\.own_rows_first=True.*'auto', 'on', 'off'",
        ),
        (_st(4, 2, zero_mapping="hpz_team"), {}, r"needs zero_optimization\.stage=3"),
        (
            _st(4, 1, zero_mapping="hpz_team"),
            {"stage": 3},
            r"startrail\.zero_mapping='hpz_team' needs startrail\.team_size > 1",
        ),
        (_st(4, 2), {"stage": 3, "reduce_scatter": False}, r"zero_optimization\.reduce_scatter"),
        (
            {**_st(4, 2), "sequence_parallel_size": 4.0},
            {},
            r"startrail\.sequence_parallel_size=4\.0",
        ),
        (_st(4, 2), {"training_data": [1, 2]}, r"training_data with startrail"),
        (_st(4, 2), {"tensor_parallel": {"autotp_size": 2}}, r"tensor_parallel\.autotp_size=2"),
        (
            _st(4, 1, ulysses_size=3),
            {},
            r"startrail\.ulysses_size=3 .*: ulysses_size=3 does not fit .*allowed: \[1, 2, 4\]",
        ),
        (
            _st(8, 2, ulysses_size=4),
            {},
            r"startrail\.ulysses_size=4 .*leaves R = 2 ranks per ring group .*team_size=2",
        ),
        (
            _st(4, 1, ulysses_size=2, zero_mapping="hpz_team"),
            {"stage": 3},
            r"startrail\.zero_mapping='hpz_team' is not supported with startrail\.ulysses_size=2",
        ),
        ({**_st(4, 1), "ulysses_size": "2"}, {}, r"startrail\.ulysses_size='2'.*valid integer"),
        (  # P = 1: the section changes nothing, so its settings would be dropped
            {"enabled": True, "sequence_parallel_size": 1, "tiled_mlp": 16, "attention_tile": 8},
            {},
            r"startrail\.attention_tile is set but startrail\.sequence_parallel_size is 1.*drop "
            r"startrail\.attention_tile, startrail\.tiled_mlp",
        ),
    ],
)
def test_invalid_sections_fail_before_anything(section, zero, match):
    import torch.distributed as dist

    model = tiny_llama()
    data = zero.pop("training_data", None)
    tp = zero.pop("tensor_parallel", None)
    cfg = make_cfg(zero.pop("stage", 1), dp=1, startrail=section, **zero)
    if tp is not None:
        cfg["tensor_parallel"] = tp
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises((ValueError, NotImplementedError), match=match):
        sds.initialize(model=model, optimizer=opt, config=cfg, training_data=data)
    assert not dist.is_initialized()  # failed before any distributed set-up
    assert model.config._attn_implementation == "sdpa" and not hasattr(model, "_startrail_handle")


def _p_not_dividing_world(rank: int, world: int):
    rank_env(rank, world)
    model = tiny_llama()
    try:
        sds.initialize(
            model=model, model_parameters=model.parameters(), config=make_cfg(1, 1, _st(3, 1))
        )
    except ValueError as e:
        return str(e), model.config._attn_implementation
    return None, model.config._attn_implementation


def test_sequence_parallel_size_must_divide_world():
    for msg, attn in run_ranks(4, _p_not_dividing_world):
        assert msg is not None and "startrail.sequence_parallel_size=3 does not divide" in msg
        assert "allowed: [1, 2, 4]" in msg and attn == "sdpa"


# ---- without an enabled section: exactly plain DeepSpeed ----------------------------------


@pytest.mark.parametrize("section", [None, {"enabled": False, "sequence_parallel_size": 4}])
def test_config_without_startrail_is_plain_deepspeed(monkeypatch, section, tmp_path):
    import argparse

    from startrail_megatron.deepspeed import internals

    calls = []
    sentinel = object()

    def spy(**kwargs):
        calls.append(kwargs)
        return sentinel

    monkeypatch.setattr(internals, "original_initialize", spy)
    model = tiny_llama()
    cfg = make_cfg(2, dp=1, startrail=section)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    assert sds.initialize(args=args, model=model, optimizer=opt) is sentinel
    (kw,) = calls
    assert kw["args"] is args and kw["model"] is model and kw["optimizer"] is opt
    assert kw["config"] is None and kw["mpu"] is None and args.deepspeed_config == str(path)
    assert model.config._attn_implementation == "sdpa" and not model._forward_pre_hooks
    assert sds.initialize(model=model, config=cfg) is sentinel and calls[1]["config"] is cfg


def test_shard_causal_lm_batch_shifts_before_sharding():
    ids = torch.arange(2 * 16).reshape(2, 16)
    shards = [sds.shard_causal_lm_batch(ids, ids, None, r, 4) for r in range(4)]
    from startrail_megatron import zigzag_unshard

    got_ids = zigzag_unshard([s["input_ids"] for s in shards], dim=1)
    got_pos = zigzag_unshard([s["position_ids"] for s in shards], dim=1)
    got_lab = zigzag_unshard([s["shift_labels"] for s in shards], dim=1)
    assert torch.equal(got_ids, ids)
    assert torch.equal(got_pos, torch.arange(16).expand(2, 16))  # global positions
    assert torch.equal(got_lab[:, :-1], ids[:, 1:]) and (got_lab[:, -1] == -100).all()
    # rank 0 holds chunks 0 and 7: tokens 0, 1 and 14, 15; its label for token 1 is token 2
    assert shards[0]["position_ids"][0].tolist() == [0, 1, 14, 15]
    assert shards[0]["shift_labels"][0].tolist() == [1, 2, 15, -100]


# ---- packed rows (DataCollatorWithFlattening) ------------------------------------------------
PACKED_STEPS = [[37, 20, 5, 60], [45, 3, 50, 1], [64, 64]]  # documents per step (a 1-token one)


def _packed_batches(steps=PACKED_STEPS):
    g = torch.Generator().manual_seed(99)
    return [[torch.randint(0, 64, (n,), generator=g) for n in docs] for docs in steps]


def _packed_reference(steps=PACKED_STEPS):
    """One rank, no DeepSpeed: every document on its own (unpacked), the loss the mean over
    all the step's predicted tokens, SGD with clipping as DeepSpeed."""
    model = tiny_llama(positions=256)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for docs in _packed_batches(steps):
        n_pred = sum(len(d) - 1 for d in docs)
        loss = (
            sum(
                model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1)
                for d in docs
                if len(d) > 1
            )
            / n_pred
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _packed_train(rank, world, stage, use_adapter=False, flash_kwargs=False, recompute=False):
    rank_env(rank, world)
    model = tiny_llama()
    if recompute:  # transformers' activation checkpointing: attention runs again in backward
        model.gradient_checkpointing_enable({"use_reentrant": False})
    cfg = make_cfg(stage, dp=1, startrail=_st(4, 2))
    engine, _, _, _ = sds.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg
    )
    rows = [  # one row per step, position ids restarting per document
        {
            "input_ids": torch.cat(docs)[None],
            "labels": torch.cat(docs)[None],
            "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None],
        }
        for docs in _packed_batches()
    ]
    if flash_kwargs:  # DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s form
        for row, docs in zip(rows, _packed_batches()):
            cu = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()])
            longest = max(len(d) for d in docs)
            del row["position_ids"]
            row.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest)
            row.update(max_length_k=longest)
    if use_adapter:  # the data loader shards; the batch carries the packed layout
        engine.startrail_handle.shard_inputs = False
        rows = sds.StarTrailDataLoaderAdapter(rows, engine.startrail_mpu)
    losses = []
    for batch in rows:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    handle, mpu = engine.startrail_handle, engine.startrail_mpu
    proof = _proof(handle.ledger, handle.local_lengths, model, mpu)
    params = _full_params(engine, stage)
    _teardown(engine)
    return losses, params, proof


@pytest.mark.parametrize(
    "stage, use_adapter, flash_kwargs, recompute",
    [
        (1, False, False, False),
        (3, False, False, False),
        (2, True, False, False),
        (1, False, True, False),
        (2, True, True, False),
        (2, False, False, True),
    ],
)
def test_packed_rows_train_like_unpacked_documents(stage, use_adapter, flash_kwargs, recompute):
    """Documents packed in one row with position_ids restarting per document give
    the losses and parameters of the documents trained unpacked on one rank (1e-5), also
    with transformers' activation checkpointing (the attention runs again in the backward,
    after the forward has returned: on the same documents)."""
    ref_losses, ref_params = _packed_reference()
    layouts = [pack_lengths(docs, 4) for docs in PACKED_STEPS]
    res = run_ranks(4, _packed_train, stage, use_adapter, flash_kwargs, recompute)
    for losses, params, proof in res:
        assert len(losses) == len(ref_losses)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= REL * abs(b), (losses, ref_losses)
        worst = max(_rel(params[k], ref_params[k]) for k in ref_params)
        assert worst <= REL, worst
        # StarTrail ran on the per-document layout: each step's padded local length, and
        # the bytes of that layout for 2 layers per step
        assert proof["attn"] == "startrail"
        assert proof["local_lengths"] == sorted({lay.s_local for lay in layouts})
        lay = StarTrailLayout(4, 2)
        want = {"fwd_p2p": 0, "bwd_p2p": 0, "fwd_collective": 0, "bwd_collective": 0}
        for packed in layouts:
            shape = LocalShape(packed.s_local, 1, 4, 2, 8, elem_bytes=4, acc_bytes=4)
            for key, v in startrail_comm_bytes(lay, proof["cp_rank"], shape).items():
                want[key] += 2 * v
                if recompute and key.startswith("fwd"):
                    want[key] += 2 * v  # each layer's forward again in the backward
        for key, v in want.items():
            assert proof["ledger"][f"{key}_bytes"] == v, key
    init = dict(tiny_llama().named_parameters())
    assert max(_rel(ref_params[k], init[k].detach()) for k in ref_params) > 1e3 * REL


# ---- per-batch layouts (startrail.hybrid_context_parallel) ------------------------------------
# Two clusters the scheduler prices on, so that the layouts it picks for these short
# documents cover every kind of block: "mixed" (slow attention, cheap GEMMs, no overlap, no
# per-call cost: blocks of 2 ranks, of 4 with C = 2, and ranks alone) and the default
# h100-ib preset (each document alone, ranks left idle).
HYBRID_STEPS = {
    "mixed": [[60, 8, 60], [200, 10, 5], [20, 20, 20, 20]],
    "h100-ib": [[64, 64], [3], [37, 20, 5, 60]],
}


def _hybrid_cluster(which: str, tmp: str) -> str:
    if which == "h100-ib":
        return which
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS

    spec = CLUSTER_PRESETS["h100-ib"].with_(
        gpus_per_node=4, attn_flops=1e10, matmul_flops=1e13, overlap=False, kernel_overhead=0.0
    )
    path = os.path.join(tmp, "cluster.json")
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(spec), f)
    return path


def _hybrid_train(rank, world, stage, use_adapter, cluster, steps, recompute, tiled=False):
    rank_env(rank, world)
    model = tiny_llama(positions=256)
    if recompute:  # transformers' activation checkpointing: attention runs again in backward
        model.gradient_checkpointing_enable({"use_reentrant": False})
    st = _st(4, 2, hybrid_context_parallel=True, batch_cluster=cluster)
    if tiled:  # every long-sequence option of the section at once
        st.update(tiled_mlp=16, tiled_loss=16, attention_tile=8, attention_head_chunks=2)
        st.update(own_rows_first="on")
    engine, _, _, _ = sds.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        config=make_cfg(stage, dp=1, startrail=st),
    )  # fmt: skip
    docs_of = _packed_batches(steps)
    rows = [
        {
            "input_ids": torch.cat(docs)[None],
            "labels": torch.cat(docs)[None],
            "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None],
        }
        for docs in docs_of
    ]
    if use_adapter:
        engine.startrail_handle.shard_inputs = False
        rows = sds.StarTrailDataLoaderAdapter(rows, engine.startrail_mpu)
    losses, lengths, sent = [], [], []
    handle = engine.startrail_handle
    for batch in rows:
        handle.local_lengths.clear()
        before = handle.ledger.summary()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lengths.append(sorted(handle.local_lengths))
        after = handle.ledger.summary()
        sent.append({k: after[k] - before.get(k, 0) for k in after if k.endswith("_bytes")})
    mpu = engine.startrail_mpu
    made = {g.own_rows_first for g in mpu.batch_groups.groups.values()}
    assert made == {mpu.config.own_rows_first_value}, made  # the section's, on every block
    layouts = list(mpu.batch_schedule.layouts)
    proof = dict(attn=model.config._attn_implementation, cp_rank=mpu.get_sequence_parallel_rank())
    params = _full_params(engine, stage)
    _teardown(engine)
    return losses, params, proof, lengths, sent, layouts


@pytest.mark.parametrize(
    "which, stage, use_adapter, recompute, tiled",
    [
        ("mixed", 1, False, False, False),
        ("h100-ib", 2, True, False, False),
        ("mixed", 3, True, False, False),
        ("mixed", 2, False, True, False),
        ("mixed", 2, False, False, True),
    ],
)
def test_hybrid_rows_train_like_unpacked_documents(
    which, stage, use_adapter, recompute, tiled, tmp_path
):
    """startrail.hybrid_context_parallel: each step's documents on the sub-groups the
    scheduler picks give the losses and parameters of the documents trained unpacked on one
    rank (1e-5), and every rank ran its block of the scheduler's layout: its local length
    (one padding token where its block is idle) and, per step, the bytes of StarTrail on
    its block (none on a rank alone): the static path (every document on all 4 ranks) fails
    both. With activation checkpointing too (the attention again in the backward), and
    with the tiled MLP and loss, attention tiles and head chunks (the same bytes)."""
    from startrail_megatron.planner.batch import schedule_batch
    from startrail_megatron.planner.cli import load_cluster
    from startrail_megatron.planner.cluster import CLUSTER_PRESETS

    steps = HYBRID_STEPS[which]
    ref_losses, ref_params = _packed_reference(steps)
    cluster = _hybrid_cluster(which, str(tmp_path))
    res = run_ranks(4, _hybrid_train, stage, use_adapter, cluster, steps, recompute, tiled)
    spec = (
        CLUSTER_PRESETS[cluster].with_(gpus_per_node=4)
        if cluster in CLUSTER_PRESETS
        else load_cluster(cluster)
    )
    from startrail_megatron.deepspeed.hybrid import _layer_model

    want = [  # the scheduler's layouts, computed here from the lengths alone
        schedule_batch(
            docs,
            4,
            heads_q=4,
            heads_kv=2,
            head_dim=8,
            elem_bytes=4,
            cluster=spec,
            team_sizes={1: 1, 2: 1, 4: 2},
            model=_layer_model(tiny_llama(positions=256)),
            recompute=recompute,
        )
        for docs in steps
    ]
    kinds = {(b.size, b.team_size, bool(b.docs)) for lay in want for b in lay.blocks}
    if which == "mixed":  # blocks of 2 (ring), of 4 (C = 2) and ranks alone all ran
        assert {(2, 1, True), (4, 2, True), (1, 1, True)} <= kinds, kinds
    else:  # ranks alone and idle ranks
        assert {(1, 1, True), (1, 1, False)} <= kinds, kinds
    for losses, params, proof, lengths, sent, layouts in res:
        assert [a == b for a, b in zip(layouts, want)] == [True] * len(steps), layouts
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= REL * abs(b), (losses, ref_losses)
        worst = max(_rel(params[k], ref_params[k]) for k in ref_params)
        assert worst <= REL, worst
        assert proof["attn"] == "startrail"
        r = proof["cp_rank"]
        for lay, got_len, got_sent in zip(want, lengths, sent):
            b = lay.block_of(r)
            assert got_len == [lay.packed(b).s_local if b.docs else 1], (r, got_len, b)
            expect = {"fwd_p2p": 0, "bwd_p2p": 0, "fwd_collective": 0, "bwd_collective": 0}
            if b.size > 1:
                shape = LocalShape(lay.packed(b).s_local, 1, 4, 2, 8, elem_bytes=4, acc_bytes=4)
                layout = StarTrailLayout(b.size, b.team_size)
                for key, v in startrail_comm_bytes(layout, r - b.start, shape).items():
                    expect[key] += 2 * v  # two layers
                    if recompute and key.startswith("fwd"):
                        expect[key] += 2 * v  # each layer's forward again in the backward
                assert sum(expect.values()) > 0
            for key, v in expect.items():
                assert got_sent.get(f"{key}_bytes", 0) == v, (r, key, got_sent, b)
    init = dict(tiny_llama(positions=256).named_parameters())
    assert max(_rel(ref_params[k], init[k].detach()) for k in ref_params) > 1e3 * REL


def test_hybrid_schedule_shards_caps_and_refuses_by_name():
    """``HybridSchedule`` alone (no ranks): a rank's rows are its block's documents with the
    labels shifted per document; an idle rank gets one padding token labelled -100; the
    token cap is kept, and a row no layout keeps within it, or several rows, are refused
    naming the setting."""
    from startrail_megatron.deepspeed.config import StarTrailConfig
    from startrail_megatron.deepspeed.hybrid import HybridSchedule

    def schedule(**kw):
        cfg = StarTrailConfig(strict=True, **_st(4, 2, hybrid_context_parallel=True, **kw))
        return HybridSchedule.for_hf_model(tiny_llama(positions=256), cfg)

    ids = torch.arange(64 + 64)[None] % 64
    pos = torch.cat([torch.arange(64), torch.arange(64)])[None]
    sched = schedule()  # h100-ib: each document alone, two ranks idle
    rows = [sched.shard(ids, ids, pos, r) for r in range(4)]
    lay = rows[0][1]
    assert all(layout == lay for _, layout in rows) and sched.layouts == [lay] * 4
    for r, (out, _) in enumerate(rows):
        b = lay.block_of(r)
        if not b.docs:
            assert out["input_ids"].tolist() == [[0]] and out["shift_labels"].tolist() == [[-100]]
            continue
        (d,) = b.docs
        doc = ids[0, 64 * d : 64 * d + 64]
        assert torch.equal(out["input_ids"][0], doc)
        assert torch.equal(out["position_ids"][0], torch.arange(64))
        assert out["shift_labels"][0].tolist() == [*doc[1:].tolist(), -100]
    assert sum(not b.docs for b in lay.blocks) == 2
    capped = schedule(max_tokens_per_rank=40)  # a document of 64 needs 2 ranks or more
    for r in range(4):
        out, lay = capped.shard(ids, ids, pos, r)
        assert out["input_ids"].shape[1] <= 40 and all(b.size > 1 for b in lay.blocks)
    with pytest.raises(ValueError, match=r"startrail\.max_tokens_per_rank=16: .*no layout"):
        schedule(max_tokens_per_rank=16).shard(ids, ids, pos, 0)
    with pytest.raises(ValueError, match=r"hybrid_context_parallel takes one row"):
        sched.shard(ids.expand(2, -1), ids.expand(2, -1), None, 0)


def _two_forwards_one_backward(rank, world):
    """Activation checkpointing: a plain row's forward, then a packed row's (the same local
    length), then their backward, in one and in two passes: each recomputed attention must
    use its own forward's documents. Returns the max relative gradient difference of each
    against the same without checkpointing."""
    from startrail_megatron.deepspeed.config import StarTrailConfig

    mpu = sds.StarTrailMPU.create(
        StarTrailConfig(strict=True, enabled=True, sequence_parallel_size=4, team_size=2)
    )
    model = tiny_llama()
    model.train()
    handle = sds.prepare_hf_model(model, mpu)
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(3))
    plain = {"input_ids": ids, "labels": ids}
    packed = dict(plain, position_ids=torch.cat([torch.arange(16), torch.arange(48)])[None])

    def grads(together: bool) -> dict:
        model.zero_grad()
        losses = [model(**plain).loss, model(**packed).loss]
        if together:
            sum(losses).backward()
        else:
            for loss in losses:
                loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    ref = grads(False)  # no recompute: each attention call ran in its own forward
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    worst = [max(_rel(g[k], ref[k]) for k in ref) for g in (grads(True), grads(False))]
    handle.remove()
    return worst, sorted(handle.local_lengths)


def test_checkpointed_forwards_keep_their_own_documents_in_one_backward():
    for worst, lengths in run_ranks(4, _two_forwards_one_backward):
        assert lengths == [16], lengths  # both rows: 16 local tokens (the silent case)
        assert max(worst) <= 1e-5, worst


def test_a_router_loss_that_would_count_p_times_is_refused():
    """A mixture-of-experts model asked for its router's load-balancing loss (added to the
    loss per rank's tokens, then summed over the P ranks) is refused before anything is
    sent; without it (the default) it trains (test_deepspeed_models.py, GPT-OSS)."""
    from types import SimpleNamespace

    from test_deepspeed_models import build

    model = build("gpt_oss", plain=True)
    handle = sds.prepare_hf_model(model, SimpleNamespace(batch_schedule=None))
    ids = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="router_aux_loss_coef > 0 .* count P times"):
        model(input_ids=ids, labels=ids, output_router_logits=True)
    handle.remove()


def test_the_adapter_refuses_padding_and_takes_flash_boundaries():
    """``StarTrailDataLoaderAdapter`` refuses a padding mask (the model's pre-hook would,
    but the adapter's batches carry no mask); its flash-attention form of a packed row is
    trained in ``test_packed_rows_train_like_unpacked_documents``."""
    from types import SimpleNamespace

    ids = torch.zeros(1, 16, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    rows = sds.StarTrailDataLoaderAdapter(
        [{"input_ids": ids, "attention_mask": mask}], SimpleNamespace(batch_schedule=None)
    )
    with pytest.raises(ValueError, match="attention_mask with padding is not supported"):
        next(iter(rows))


def test_packed_position_ids_are_refused_by_name():
    """Documents packed in one row (position_ids restarting) must not train silently
    as one causal sequence; the same ids without restarts are accepted."""
    lengths = (37, 90, 5, 124)  # four documents, 256 tokens in one row
    packed = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    ids = torch.zeros_like(packed)
    with pytest.raises(ValueError, match=r"position_ids: packed sequences .* not supported"):
        sds.shard_causal_lm_batch(ids, ids, packed, 0, 4)
    jump = torch.arange(256).unsqueeze(0).clone()
    jump[0, 100:] += 7  # a gap, no restart: still not one consecutive sequence
    with pytest.raises(ValueError, match="packed sequences"):
        sds.shard_causal_lm_batch(ids, ids, jump, 0, 4)
    shifted = torch.arange(256).unsqueeze(0) + 5  # an offset keeps the relative positions
    assert sds.shard_causal_lm_batch(ids, ids, shifted, 1, 4)["position_ids"].shape == (1, 64)


def _misuse(rank: int, world: int):
    from startrail_megatron.deepspeed.config import StarTrailConfig

    mpu = sds.StarTrailMPU.create(
        StarTrailConfig(strict=True, enabled=True, sequence_parallel_size=4)
    )
    model = tiny_llama()
    handle = sds.prepare_hf_model(model, mpu)
    errors = []
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(rank))
    for kwargs in (
        {"input_ids": ids, "labels": ids},  # a different batch on every rank
        {"input_ids": ids * 0, "attention_mask": torch.zeros_like(ids)},  # padding
        # a packed row whose ids jump inside a document (not 0, 1, 2, ...): refused
        {"input_ids": ids * 0, "position_ids": torch.tensor([[0, 1, 2, 0, 5, 6] + [7] * 10])},
        # two packed rows in one batch: refused (one row per batch, as the collator makes)
        {
            "input_ids": torch.zeros(2, SEQ, dtype=torch.long),
            "position_ids": torch.arange(SEQ).remainder(SEQ // 2).expand(2, SEQ),
        },
    ):
        try:
            model(**kwargs)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    out = model(input_ids=ids * 0, attention_mask=torch.ones_like(ids))  # all ones: accepted
    handle.remove()
    restored = model.config._attn_implementation == "sdpa" and not model._forward_pre_hooks
    return errors, out.logits.shape[1], restored


def test_misuse_is_refused_and_prepare_is_reversible():
    for errors, local_len, restored in run_ranks(4, _misuse):
        assert "were given different batches" in errors[0]
        assert "attention_mask with padding is not supported" in errors[1]
        assert "position_ids[4] = 5 after 0" in errors[2]
        assert "need one row per batch" in errors[3]
        assert local_len == SEQ // 4 and restored


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dp2_x_p4_on_8_ranks(stage):
    cfg = make_cfg(stage, dp=2, startrail=_st(4, 2))
    _check(run_ranks(8, _train, cfg), world=8, p=4)


@pytest.mark.slow
@pytest.mark.parametrize("p, placement", [(4, "team"), (8, "ring")])
def test_hpz_team_is_the_hierarchical_partition_group(p, placement):
    # (8, "ring"): G = 2, so a team is ranks {t, t + 2}: not DeepSpeed's contiguous groups
    cfg = make_cfg(3, dp=8 // p, startrail=_st(p, 2, zero_mapping="hpz_team", placement=placement))
    results = run_ranks(8, _train, cfg)
    _check(results, world=8, p=p)
    if placement == "ring":
        assert results[0][2]["team"] == [0, 2]
    for rank, (_, _, info) in enumerate(results):
        assert info["hpz"] == info["team"], (rank, info)
        assert len(info["hpz"]) == 2 and rank in info["hpz"] and info["stage3_hpz"] == 2


# ---- the CUDA device is set before the groups communicate -----------------------------------


class _FakeAccelerator:
    """The accelerator calls ``initialize`` makes, as on a CUDA (or CPU) machine."""

    def __init__(self, name: str = "cuda", current: int = 0):
        self.name, self.current, self.calls = name, current, []

    def device_name(self, device_index=None):
        return self.name if device_index is None else f"{self.name}:{device_index}"

    def current_device(self):
        return self.current

    def set_device(self, index):
        self.calls.append(index)
        self.current = index

    def communication_backend_name(self):
        return "nccl" if self.name == "cuda" else "gloo"


def test_initialize_sets_the_cuda_device_before_creating_groups(monkeypatch):
    import deepspeed.accelerator
    import deepspeed.comm
    import torch.distributed as dist

    fake = _FakeAccelerator()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    monkeypatch.setattr(deepspeed.comm, "init_distributed", lambda **kwargs: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    seen = []

    class Stop(Exception):
        pass

    def create(config):  # StarTrailMPU.create: the first collective
        seen.append(fake.current)
        raise Stop

    monkeypatch.setattr(sds.StarTrailMPU, "create", staticmethod(create))
    model = tiny_llama()
    with pytest.raises(Stop):
        sds.initialize(
            model=model, model_parameters=model.parameters(), config=make_cfg(1, 1, _st(4, 2))
        )
    assert seen == [3] and fake.calls == [3]


@pytest.mark.parametrize(
    "name, env, args, current, calls",
    [
        ("cpu", {"LOCAL_RANK": "3"}, None, 0, []),  # not CUDA: nothing
        ("cuda", {"LOCAL_RANK": "3"}, None, 3, []),  # already set
        ("cuda", {}, None, 0, []),  # no local rank known
        ("cuda", {}, {"local_rank": 2}, 0, [2]),
        ("cuda", {"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, None, 0, [1]),
        ("cuda", {"LOCAL_RANK": "1"}, {"local_rank": 1, "device_rank": 5}, 0, [5]),  # as the engine
    ],
)
def test_set_local_device(monkeypatch, name, env, args, current, calls):
    import argparse

    import deepspeed.accelerator

    from startrail_megatron.deepspeed import entry

    fake = _FakeAccelerator(name, current)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    entry.set_local_device(None if args is None else argparse.Namespace(**args))
    assert fake.calls == calls


# ---- the HF attention function refuses what it would not compute -----------------------------


def _hf_call(monkeypatch, **kwargs):
    from types import SimpleNamespace

    from startrail_megatron.deepspeed import hf

    calls = []

    def fake(
        q, k, v, groups, causal, softmax_scale, ledger, cu_seqlens, cu_seqlens_padded, dropout_p,
        tile, head_chunks=None, **extra,
    ):  # fmt: skip
        calls.append({"causal": causal, "softmax_scale": softmax_scale, **extra})
        if dropout_p:
            calls[-1]["dropout_p"] = dropout_p
        if tile is not None:
            calls[-1]["tile"] = tile
        return q

    monkeypatch.setattr(hf, "startrail_attention", fake)
    module = torch.nn.Module()
    module.is_causal = True
    handle = SimpleNamespace(
        mpu=SimpleNamespace(
            startrail=SimpleNamespace(cp_size=4),
            config=SimpleNamespace(attention_tile=None, attention_head_chunks=None),
        ),
        ledger=None,
        local_lengths=set(),
        documents=SimpleNamespace(of=lambda position_ids: None),
        dropout_calls=0,
    )
    setattr(module, hf._SPEC_ATTR, handle)
    q = torch.zeros(1, 4, 8, 16)  # [b, hq, S/P, d]: the global sequence is 32
    kv = torch.zeros(1, 2, 8, 16)
    out, weights = hf.startrail_hf_attention(module, q, kv, kv, None, **kwargs)
    assert weights is None and out.shape == (1, 8, 4, 16)
    return calls


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"position_bias": torch.zeros(1)}, r"position_bias"),
        ({"cu_seq_lens_q": torch.tensor([0, 5, 32])}, r"cu_seq_lens_q.*packed sequences"),
    ],
)
def test_hf_attention_refuses_unsupported_arguments(monkeypatch, kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        _hf_call(monkeypatch, **kwargs)


def test_hf_attention_refuses_bad_windows_and_double_sinks(monkeypatch):
    with pytest.raises(ValueError, match="sliding_window=0 must be an integer >= 1"):
        _hf_call(monkeypatch, sliding_window=0)
    with pytest.raises(ValueError, match="give attention sinks once"):
        _hf_call(monkeypatch, s_aux=torch.zeros(4), sinks=torch.zeros(4))


def test_hf_attention_accepts_unset_arguments(monkeypatch):
    unset = dict(sliding_window=None, softcap=None, s_aux=None, sinks=None, position_bias=None)
    assert _hf_call(monkeypatch, dropout=0.0, scaling=0.125, **unset) == [
        {"causal": True, "softmax_scale": 0.125}
    ]
    assert _hf_call(monkeypatch, dropout=0.1) == [
        {"causal": True, "softmax_scale": None, "dropout_p": 0.1}
    ]
    # sliding windows, soft-capping and sinks go to StarTrail (a window of the last W keys)
    sinks = torch.zeros(4)
    got = _hf_call(monkeypatch, sliding_window=31, softcap=50.0, s_aux=sinks)
    assert got == [
        {"causal": True, "softmax_scale": None, "window": (30, 0), "softcap": 50.0, "sinks": sinks}
    ]


# ---- attention dropout ---------------------------------------------------------------------
def _dropout_run(rank, world, seed, attention_dropout):
    rank_env(rank, world)
    model = tiny_llama(attention_dropout)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = sds.initialize(model=model, optimizer=opt, config=make_cfg(1, 1, _st(4, 2)))
    batches = global_batches(1)
    engine.eval()  # evaluation: transformers passes dropout 0
    with torch.no_grad():
        eval_loss = engine(input_ids=batches[0][0], labels=batches[0][1]).loss.item()
    engine.train()
    torch.manual_seed(seed)  # where the attention draws its masks (transformers' eager does too)
    losses = []
    for ids, labels in batches:
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    calls = engine.startrail_handle.dropout_calls
    _teardown(engine)
    return losses, eval_loss, calls


def test_hf_attention_dropout_is_reproducible_and_off_in_evaluation():
    """A Llama with attention_dropout 0.1 (ZeRO-1, P = 4, C = 2): two runs with the same seed
    train bitwise alike, another seed differently, and differently from attention_dropout 0
    (the masks were used, in every layer at every step); evaluation is bitwise the model
    without dropout."""
    a = run_ranks(4, _dropout_run, 1, 0.1)
    b = run_ranks(4, _dropout_run, 1, 0.1)
    other = run_ranks(4, _dropout_run, 2, 0.1)
    none = run_ranks(4, _dropout_run, 1, 0.0)
    assert [r[0] for r in a] == [r[0] for r in b]
    assert a[0][0] != other[0][0] and a[0][0] != none[0][0]
    for ra, rn in zip(a, none):
        assert ra[1] == rn[1]  # evaluation: bitwise the same
        assert ra[2] == 3 * 2 and rn[2] == 0  # dropout in 2 layers x 3 steps


# ---- the launcher under the deepspeed launcher, and hjson configs --------------------------


@pytest.mark.parametrize(
    "argv, want, local_rank",
    [
        (["t.py", "--x", "1"], ["t.py", "--x", "1"], None),
        (["--local_rank=2", "t.py", "--x"], ["t.py", "--local_rank=2", "--x"], 2),
        (["--local_rank", "2", "t.py"], ["t.py", "--local_rank", "2"], 2),
        (["--local-rank=1", "t.py", "--y"], ["t.py", "--local-rank=1", "--y"], 1),
    ],
)
def test_launch_moves_local_rank_after_the_script(argv, want, local_rank):
    from startrail_megatron.deepspeed import launch

    assert launch.split_argv(argv) == (want, local_rank)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--local_rank=x", "t.py"], r"--local_rank=x"),
        (["--local_rank"], r"--local_rank"),
        (["--local_rank=0"], r"training script"),
        (["--foo", "t.py"], r"training script"),
    ],
)
def test_launch_argv_errors(argv, match):
    from startrail_megatron.deepspeed import launch

    with pytest.raises(ValueError, match=match):
        launch.split_argv(argv)


def test_launch_main_as_the_deepspeed_launcher_runs_it(tmp_path, monkeypatch):
    # deepspeed --module startrail_megatron.deepspeed.launch t.py ... runs
    # python -u -m startrail_megatron.deepspeed.launch --local_rank=N t.py ...
    from startrail_megatron.deepspeed import launch

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")  # restored (removed) afterwards
    out = tmp_path / "seen.json"
    script = tmp_path / "t.py"
    script.write_text(
        "import json, os, sys\n"
        f"json.dump([sys.argv, os.environ.get('LOCAL_RANK')], open({str(out)!r}, 'w'))\n"
    )
    launch.main(["--local_rank=1", str(script), "--a"])
    assert json.loads(out.read_text()) == [[str(script), "--local_rank=1", "--a"], "1"]


def test_flash_varlen_kwargs_become_position_ids_or_are_refused():
    from startrail_megatron.deepspeed.batches import position_ids_from_flash_kwargs as conv

    ids = torch.zeros(1, 7, dtype=torch.long)
    cu = torch.tensor([0, 3, 3, 7])
    kw = {"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 4}
    assert conv(kw, ids.shape).tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert not any(k in kw for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q"))
    for bad, match in [
        ({"cu_seq_lens_q": cu, "cu_seq_lens_k": torch.tensor([0, 7])}, "must both be given"),
        ({"cu_seq_lens_q": torch.tensor([0, 5])}, "from 0 to the row's length 7"),
        ({"cu_seq_lens_q": torch.tensor([0, 5, 2, 7])}, "must not decrease"),
        ({"cu_seq_lens_q": cu, "position_ids": torch.arange(7)[None]}, "disagree"),
    ]:
        with pytest.raises(ValueError, match=match):
            conv({"input_ids": ids, **bad}, ids.shape)
    assert conv({"input_ids": ids, "position_ids": None}, ids.shape) is None


def _train_tiled(rank, world, cfg, module, ops, tied=False):
    """``_train``, with ``deepspeed.<module>``'s tiling function (``tile_hf_mlps`` or
    ``tile_hf_loss``) wrapped to keep the stats it makes on this rank, and the most rows any
    output of the aten ``ops`` had (its elements over its last dimension; batch 1), forward
    and backward."""
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    mod = importlib.import_module(f"startrail_megatron.deepspeed.{module}")
    name = "tile_hf_mlps" if module == "tiled_mlp" else "tile_hf_loss"
    made, plain = [], getattr(mod, name)
    watched = {getattr(torch.ops.aten, op).default for op in ops}

    def capture(*args):
        made.append(plain(*args))
        return made[-1]

    class Rows(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in watched:
                Rows.rows = max(Rows.rows, out.numel() // out.shape[-1])
            return out

    setattr(mod, name, capture)
    try:
        with Rows():
            res = _train(rank, world, cfg, tied=tied)
    finally:
        setattr(mod, name, plain)
    keys = ("layers", "calls", "shards") if module == "tiled_mlp" else ("calls", "shards")
    counts = [{**{k: getattr(s, k) for k in keys}, "rows": s.max_shard_rows} for s in made]
    return (*res, counts, Rows.rows)


_MLP_OPS = ("silu", "silu_backward")
"""The MLP's intermediate, ``act_fn(gate_proj(x))``, forward and backward."""
_LOSS_OPS = ("_log_softmax", "_log_softmax_backward_data")
"""The cross-entropy's ``[rows, vocab]`` (the tiny Llama's MLP is VOCAB wide too)."""


@pytest.mark.parametrize("stage", [0, 3])
def test_tiled_mlp_matches_single_rank_and_keeps_one_shard(stage):
    """``"tiled_mlp": 2`` (DeepSpeed's own ``TiledMLP``): the same losses and parameters as
    the one-rank run without DeepSpeed (ZeRO 0 and 3: its gradients held back until the last
    shard), the stats prove both layers' MLPs ran in 2 shards of 2 rows per call, and no
    MLP intermediate is larger than a shard (4 local rows untiled)."""
    cfg = make_cfg(stage, dp=1, startrail=_st(4, 2, tiled_mlp=2))
    res = run_ranks(4, _train_tiled, cfg, "tiled_mlp", _MLP_OPS)
    _check([r[:3] for r in res], world=4, p=4)
    for *_, made, rows in res:
        (stats,) = made
        assert stats["layers"] == 2 and stats["rows"] == 2, stats
        assert stats["calls"] >= 2 * STEPS and stats["shards"] == 2 * stats["calls"], stats
        assert rows == 2, rows
    plain = run_ranks(
        4, _train_tiled, make_cfg(stage, dp=1, startrail=_st(4, 2)), "tiled_mlp", _MLP_OPS
    )
    assert all(r[-2] == [] and r[-1] == 4 for r in plain)  # untiled: the local 4 rows


def _train_watching_calls(rank, world, cfg):
    """``_train`` with every attention kernel call watched: the most query and key rows of
    any call."""
    from startrail_megatron.kernels import SdpaKernel, TorchKernel

    largest = [0, 0, 0]  # query rows, key rows, query heads
    saved = [(cls, cls.forward, cls.backward) for cls in (TorchKernel, SdpaKernel)]

    def watch(fn):
        def run(self, *a, **kw):
            q, k = (a[0], a[1]) if fn.__name__ == "forward" else (a[1], a[2])
            largest[0], largest[1] = max(largest[0], q.shape[0]), max(largest[1], k.shape[0])
            largest[2] = max(largest[2], q.shape[2])
            return fn(self, *a, **kw)

        return run

    for cls, f, b in saved:
        cls.forward, cls.backward = watch(f), watch(b)
    try:
        res = _train(rank, world, cfg)
    finally:
        for cls, f, b in saved:
            cls.forward, cls.backward = f, b
    return (*res, largest)


def test_attention_tile_matches_single_rank_and_bounds_every_call():
    """``"attention_tile": 3``: the same losses and parameters as the one-rank run, every
    attention kernel call at most 3 x 3 rows (whole calls are larger: the key ran)."""
    cfg = make_cfg(0, dp=1, startrail=_st(4, 2, attention_tile=3))
    res = run_ranks(4, _train_watching_calls, cfg)
    _check([r[:3] for r in res], world=4, p=4)
    assert all(max(r[-1][:2]) <= 3 for r in res), [r[-1] for r in res]
    plain = run_ranks(4, _train_watching_calls, make_cfg(0, dp=1, startrail=_st(4, 2)))
    assert all(max(r[-1][:2]) > 3 for r in plain), [r[-1] for r in plain]


def test_attention_head_chunks_match_single_rank_and_halve_every_call():
    """``"attention_head_chunks": 2``: the same losses and parameters as the one-rank run,
    no attention kernel call on more than half the query heads (all of them without: the
    key ran)."""
    cfg = make_cfg(0, dp=1, startrail=_st(4, 2, attention_head_chunks=2))
    res = run_ranks(4, _train_watching_calls, cfg)
    _check([r[:3] for r in res], world=4, p=4)
    plain = run_ranks(4, _train_watching_calls, make_cfg(0, dp=1, startrail=_st(4, 2)))
    for got, want in zip(res, plain):
        assert 2 * got[-1][2] == want[-1][2] > 1, (got[-1], want[-1])


@pytest.mark.parametrize("bad", [0, -1, "auto", 2.5, True])
def test_bad_attention_tile_is_refused_naming_the_key(bad):
    from startrail_megatron.deepspeed.config import StarTrailConfig

    with pytest.raises(ValueError, match="startrail.attention_tile"):
        StarTrailConfig.from_ds_config({"startrail": _st(4, 2, attention_tile=bad)})
    with pytest.raises(ValueError, match="startrail.attention_head_chunks"):
        StarTrailConfig.from_ds_config({"startrail": _st(4, 2, attention_head_chunks=bad)})


def test_tiled_mlp_refusals():
    """A bad ``startrail.tiled_mlp`` is a ``ValueError`` naming the key; an MoE block is
    refused by name (GPT-OSS' experts), and so is an MLP that applies dropout."""
    from test_deepspeed_models import build

    from startrail_megatron.deepspeed.config import StarTrailConfig
    from startrail_megatron.deepspeed.tiled_mlp import tile_hf_mlps

    with pytest.raises(ValueError, match="startrail.tiled_mlp"):
        StarTrailConfig.from_ds_config({"startrail": _st(4, 2, tiled_mlp=0)})
    with pytest.raises(ValueError, match="startrail.tiled_mlp"):
        StarTrailConfig.from_ds_config({"startrail": _st(4, 2, tiled_mlp="auto")})
    with pytest.raises(ValueError, match="startrail.tiled_mlp: GptOssMLP is a mixture-of"):
        tile_hf_mlps(build("gpt_oss", plain=True), 2)
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    coder = Starcoder2ForCausalLM(
        Starcoder2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, residual_dropout=0.1,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"Starcoder2MLP applies dropout \(residual_dropout=0.1"):
        tile_hf_mlps(coder, 2)  # TiledMLP's recompute would draw other masks
    llama = tiny_llama()
    stats = tile_hf_mlps(llama, 2)
    assert stats.layers == 2 and all("forward" in m.mlp.__dict__ for m in llama.model.layers)
    stats.remove()
    assert not any("forward" in m.mlp.__dict__ for m in llama.model.layers)


@pytest.mark.parametrize(
    "stage, gas, tied", [(0, 1, False), (2, 2, False), (3, 1, False), (2, 1, True), (3, 2, True)]
)
def test_tiled_loss_matches_single_rank_and_keeps_one_shard(stage, gas, tied):
    """``"tiled_loss": 2`` (DeepSpeed's own ``sequence_tiled_compute``): the same losses and
    parameters as the one-rank run without DeepSpeed, lm_head's weight included (ZeRO 0, 2
    with 2 micro-batches per step, 3 with its gradient scale: the weight gradient follows
    the incoming gradient; with tied embeddings under ZeRO 2 and 3, whose gradient is reduced
    once: DeepSpeed asserts on a second reduction); the stats prove 2 shards of 2 rows per
    forward, and the cross-entropy never saw more than a shard's rows (untiled: the local 4)."""
    cfg = make_cfg(stage, dp=1, startrail=_st(4, 2, tiled_loss=2))
    cfg.update(gradient_accumulation_steps=gas, train_batch_size=gas)
    res = run_ranks(4, _train_tiled, cfg, "tiled_loss", _LOSS_OPS, tied)
    ref = reference_run(gas, model=tiny_llama(tied=True)) if tied else _reference(gas)
    _check([r[:3] for r in res], world=4, p=4, ref=ref)
    for *_, made, rows in res:
        assert made == [dict(calls=STEPS * gas, shards=2 * STEPS * gas, rows=2)], made
        assert rows == 2, rows
    if stage == 0:
        plain = run_ranks(
            4, _train_tiled, make_cfg(stage, dp=1, startrail=_st(4, 2)), "tiled_loss", _LOSS_OPS
        )
        assert all(r[-2] == [] and r[-1] == 4 for r in plain)  # untiled: the local 4 rows


def test_tiled_loss_in_bf16_within_bf16s_own_error():
    """bf16 under ZeRO 2 (bf16 model and logits, fp32 master weights), with the tiled loss
    and without, each against the float64 one-process run: the tiled run's losses and
    parameters are as close to it as the untiled run's, up to bf16's rounding in another
    summation order (the loss summed per shard), and the stats prove the tiling ran.
    Measured: losses 2.6e-5 tiled, 1.6e-5 untiled; parameters 5.4e-3 of each tensor's
    largest entry both (a bf16 step of it: 3.9e-3)."""
    cfg = make_cfg(2, dp=1, startrail=_st(4, 2, tiled_loss=2))
    cfg["bf16"] = {"enabled": True}
    plain_cfg = make_cfg(2, dp=1, startrail=_st(4, 2))
    plain_cfg["bf16"] = {"enabled": True}
    ref_losses, ref_params = reference_run(1, model=tiny_llama().double())
    tiled = run_ranks(4, _train_tiled, cfg, "tiled_loss", _LOSS_OPS)
    plain = run_ranks(4, _train_tiled, plain_cfg, "tiled_loss", _LOSS_OPS)

    def worst(res):
        losses = max(abs(a - b) / abs(b) for r in res for a, b in zip(r[0], ref_losses))
        params = max(_rel(r[1][k].double(), ref_params[k]) for r in res for k in ref_params)
        return losses, params

    for *_, info, made, rows in tiled:
        assert info["elem_bytes"] == 2  # the model ran in bf16
        assert made == [dict(calls=STEPS, shards=2 * STEPS, rows=2)] and rows == 2, (made, rows)
    assert all(r[-2] == [] and r[-1] == 4 for r in plain)
    (tl, tp), (pl, pp) = worst(tiled), worst(plain)
    assert tl <= max(2 * pl, BF16_LOSS_TOL) and tl <= BF16_LOSS_TOL, (tl, pl)
    assert tp <= max(1.5 * pp, BF16_PARAM_TOL / 2) and tp <= BF16_PARAM_TOL, (tp, pp)


def _tiled_loss_logits(rank, world, cfg):
    """One forward with labels and the tiled loss on: its loss, and what reading the
    output's logits raises; one forward without labels: real logits."""
    rank_env(rank, world)
    model = tiny_llama()
    engine, _, _, _ = sds.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg
    )
    ids, labels = global_batches(1)[0]
    out = engine(input_ids=ids, labels=labels)
    try:
        out.logits.argmax(-1)
        error = None
    except NotImplementedError as e:
        error = str(e)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    _teardown(engine)
    return out.loss.item(), error, tuple(logits.shape), bool(torch.isfinite(logits).all())


def test_tiled_loss_never_makes_logits_and_refuses_reading_them():
    """With labels the logits are never made: using ``output.logits`` raises naming
    ``startrail.tiled_loss``; without labels (evaluation, generation) lm_head runs as usual
    (this rank's 4 tokens)."""
    cfg = make_cfg(0, dp=1, startrail=_st(4, 2, tiled_loss=2))
    for loss, error, shape, finite in run_ranks(4, _tiled_loss_logits, cfg):
        assert loss == pytest.approx(_reference(1)[0][0], rel=1e-5)
        assert error is not None and "startrail.tiled_loss" in error and "argmax" in error
        assert shape == (1, SEQ // 4, VOCAB) and finite


def test_tiled_loss_refusals():
    """A bad ``startrail.tiled_loss``, a model that soft-caps its logits, a model without
    ``lm_head``: ``ValueError`` naming the key; any use of deferred logits raises by name."""
    from test_deepspeed_models import build

    from startrail_megatron.deepspeed.config import StarTrailConfig
    from startrail_megatron.deepspeed.tiled_loss import DeferredLogits, check_hf_loss

    for bad in (0, "auto", 1.5):
        with pytest.raises(ValueError, match="startrail.tiled_loss"):
            StarTrailConfig.from_ds_config({"startrail": _st(4, 2, tiled_loss=bad)})
    gemma = build("gemma2", plain=True)
    check_hf_loss(gemma, 2)
    gemma.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"startrail.tiled_loss: .*final_logit_softcapping=30"):
        check_hf_loss(gemma, 2)
    with pytest.raises(ValueError, match="startrail.tiled_loss: LlamaModel has no lm_head"):
        check_hf_loss(tiny_llama().model, 2)
    llama = tiny_llama()
    deferred = DeferredLogits(torch.zeros(1, 4, 32), llama.lm_head, VOCAB, "LlamaForCausalLM")
    assert deferred.shape == (1, 4, VOCAB) and not deferred.requires_grad
    for use in (lambda t: t * 2.0, lambda t: torch.tanh(t), lambda t: t.float()):
        with pytest.raises(NotImplementedError, match="startrail.tiled_loss: LlamaForCausalLM"):
            use(deferred)


def _train_capped_hf(rank, world, cfg, seq, vocab, cap):
    """One DeepSpeed step of a tiny Llama (vocabulary ``vocab``) on a ``seq``-token sequence,
    every tensor an operator makes of ``cap`` bytes or more recorded as (op, shape, bytes)
    (recorded, not raised, so every rank finishes its step); the loss."""
    rank_env(rank, world)
    model = tiny_llama(vocab=vocab, positions=seq)
    engine, _, _, _ = sds.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg
    )
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(5))
    with AllocationCap(cap) as capped:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    lengths = sorted(engine.startrail_handle.local_lengths)
    _teardown(engine)
    return loss.item(), capped.over, lengths


def test_no_tensor_quadratic_in_the_sequence_nor_sequence_by_vocabulary_hf():
    """The transformers path at 8,192 tokens (2,048 per rank), vocabulary 4,096, with the
    tiled loss and MLP: no tensor of 3 MiB or more anywhere in the step (forward, backward,
    optimizer): not the logits (2,048 x 4,096 fp32 = 32 MiB per rank), no 4-D attention mask
    (transformers builds none for StarTrail's implementation; the local causal one alone
    would be 4 MiB, a full one 64 MiB), no attention scores of the local sequence. So no
    such tensor could have been allocated under a 3 MiB limit. With the tiled loss off the
    same step makes the logits, and fails."""
    cap, seq, vocab = 3 * 2**20, 8192, 4096
    cfg = make_cfg(0, dp=1, startrail=_st(4, 2, tiled_loss=64, tiled_mlp=128))
    for loss, over, lengths in run_ranks(4, _train_capped_hf, cfg, seq, vocab, cap):
        assert over == [], over[:5]
        assert lengths == [seq // 4] and 8.0 < loss < 8.7  # ln(4096) = 8.3: it trained
    cfg = make_cfg(0, dp=1, startrail=_st(4, 2, tiled_mlp=128))
    for _, over, _ in run_ranks(4, _train_capped_hf, cfg, seq, vocab, cap):
        assert any(shape[-1] == vocab and seq // 4 in shape for _, shape, _ in over), over[:5]


def _mpu_timeouts(rank: int, world: int):
    from startrail_megatron.groups import group_timeout

    cfg = sds.StarTrailConfig.from_ds_config({"startrail": _st(2, 1)})
    mpu = sds.StarTrailMPU.create(cfg)
    groups = (mpu.sequence_parallel_group, mpu.sequence_data_parallel_group)
    return group_timeout(None), [group_timeout(g) for g in (*groups, mpu.startrail.team_group)]


def test_the_groups_take_the_worlds_timeout_not_torchs_30_minutes():
    """DeepSpeed's sequence-parallel and ZeRO groups (ours: the mpu's) and StarTrail's take
    the world's collective timeout (``deepspeed.init_distributed(timeout=)``): a stalled
    peer ends the job when configured (they took torch's 30-minute default, and a campaign
    run with a 1-minute timeout hung)."""
    from datetime import timedelta

    for world_t, group_ts in run_ranks(4, _mpu_timeouts):
        assert world_t is not None and world_t < timedelta(minutes=5)  # the pool's
        assert group_ts == [world_t] * 3, (world_t, group_ts)
