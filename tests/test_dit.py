"""Diffusion transformers on StarTrail.

Training parity in float64: a DiT (and an MMDiT with replicated text tokens) trained on
P = 8 ranks (C = 1, 2; team and ring placement), P = 4 C = 2 and 2 replicas x P = 4,
with even and uneven token counts, gives the losses and parameters of one process over
several AdamW steps. The adaLN-Zero layers are re-randomised first so every parameter has
a gradient (else most of a block would pass vacuously). Each run proves StarTrail ran
(attention calls, K,V bytes, local token counts) and the reference differs from a run
whose attention sees only its own tokens. The group RNG check fails on purpose, and the
trainer runs it every step (a draw that differs at the last step only stops it); the
wrapper refuses a module that does not call SDPA; bad settings are refused by name.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from common import groups_for, own_rows_first_env, value_errors
from harness import run_ranks

from startrail_megatron.dit import (
    DiTConfig,
    StarTrailSDPA,
    TokenSharding,
    check_replicated,
    wrap_attention,
)
from startrail_megatron.dit.data import ReplicaBatches
from startrail_megatron.dit.loop import TrainArgs, reference_run, run_training
from startrail_megatron.schedule.layout import StarTrailLayout

TOL = 1e-9
STEPS = 3


def _args(image=(8, 8), text=0, c=1, placement="team", cp=None, **kw) -> TrainArgs:
    model = DiTConfig(
        height=image[0], width=image[1], patch_size=2, in_channels=2, hidden_size=24, depth=2,
        num_heads=4, num_classes=3, text_tokens=text, text_dim=8,
    )  # fmt: skip
    return TrainArgs(
        model=model, steps=STEPS, micro_batch_size=2, lr=1e-2, seed=3, team_size=c,
        placement=placement, cp_size=cp, dtype="fp64", kernel="torch", log_interval=100,
        randomize_zero_init=True, **kw,
    )  # fmt: skip


def _train_case(rank, world, args: TrainArgs, new_groups: bool = False):
    """``new_groups``: the trainer creates its own (``--own-rows-first`` reaches them);
    the proof then counts the own-row calls the first steps' splits made."""
    made: list[int] = []
    if new_groups:
        with own_rows_first_env(None) as made:
            res = run_training(args, groups=None, log=lambda *_: None)
    else:
        ours = args.cp_size in (None, world)
        groups = groups_for(args.team_size, args.placement) if ours else None
        res = run_training(args, groups=groups, log=lambda *_: None)
    h = res.handle
    params = {k: v.detach().clone() for k, v in res.model.named_parameters()}
    proof = {
        "calls": h.sdpa.calls,
        "kv_bytes": h.sdpa.ledger.bytes(what="kv") + h.sdpa.ledger.bytes(what="kv_place"),
        "joint_bytes": h.sdpa.ledger.bytes(what="joint_out"),
        "s_local": h.tokens.s_local,
        "padded": h.tokens.padded,
        "own_row_calls": sum(made),
        "cp_rank": h.groups.cp_rank,
    }
    h.remove()
    return res.losses, params, proof


def _check_parity(results, args: TrainArgs, replicas: int = 1) -> None:
    want_losses, want_params = reference_run(args, replicas)
    p = args.cp_size or len(results)
    for rank, (losses, params, proof) in enumerate(results):
        assert len(losses) == len(want_losses) > 0, (rank, losses, want_losses)
        for a, b in zip(losses, want_losses):
            assert abs(a - b) <= TOL * abs(b), (rank, losses, want_losses)
        for k, v in params.items():
            err = (v - want_params[k]).abs().max() / want_params[k].abs().max().clamp_min(1e-30)
            assert err <= TOL, (rank, k, err.item())
        # StarTrail ran: every block's attention, on this rank's share of the tokens
        assert proof["calls"] == STEPS * args.model.depth, proof
        assert proof["kv_bytes"] == _kv_bytes_to_send(args, p, proof), (rank, proof)
        n = args.model.num_tokens
        assert proof["s_local"] == -(-n // (2 * p)) * 2, proof
        assert proof["padded"] == (n % (2 * p) != 0)
        if args.model.text_tokens:
            assert proof["joint_bytes"] > 0
    assert sum(r[2]["kv_bytes"] for r in results) > 0
    # the parameters moved, and the steps changed every tensor (no vacuous check)
    init = {k: v for k, v in _init_params(args).items()}
    moved = [k for k in init if (init[k] - want_params[k]).abs().max() > 1e-6]
    assert len(moved) == len(init), sorted(set(init) - set(moved))


def _kv_bytes_to_send(args: TrainArgs, p: int, proof: dict) -> int:
    """The K,V bytes CP rank ``proof["cp_rank"]`` must send in the whole run: per attention
    call, forward and backward, its placement pieces and its team-sized sub-ring hops
    (``StarTrailLayout.p2p_sends``; the sizes as in ``accounting.startrail_comm_bytes``)."""
    cfg = args.model
    lay = StarTrailLayout(p, args.team_size, args.placement)
    sends = lay.p2p_sends(proof["cp_rank"], backward=True)
    head_dim = cfg.hidden_size // cfg.num_heads
    local_kv = 2 * proof["s_local"] * args.micro_batch_size * cfg.num_heads * head_dim * 8
    per_pass = sends["kv_place"] * local_kv + sends["kv"] * args.team_size * local_kv
    return 2 * per_pass * STEPS * cfg.depth


def _init_params(args):
    from startrail_megatron.dit.loop import build_model

    return {k: v.detach().clone() for k, v in build_model(args).named_parameters()}


@pytest.mark.parametrize(
    "p, c, placement, image, text",
    [
        (8, 1, "team", (8, 8), 0),  # 16 tokens = 2P: plain zigzag
        (8, 2, "team", (8, 8), 0),
        (8, 2, "ring", (10, 6), 0),  # 15 tokens: padded to 16
        (4, 2, "team", (6, 10), 3),  # MMDiT, 15 tokens padded to 16, 3 text tokens
        (8, 2, "ring", (8, 8), 4),  # MMDiT
    ],
)
def test_dit_training_matches_one_process_fp64(p, c, placement, image, text):
    args = _args(image, text, c, placement)
    results = run_ranks(p, _train_case, args)
    _check_parity(results, args)


def test_own_rows_first_flag_reaches_the_trainers_groups():
    """``--own-rows-first on``: the groups the trainer creates split the first step (full
    attention on one host would keep it whole by default), and training is still exact."""
    args = _args((8, 8), 0, 2, own_rows_first="on")
    results = [r for r in run_ranks(4, _train_case, args, True)]
    _check_parity(results, args)
    assert all(r[2]["own_row_calls"] > 0 for r in results), [r[2] for r in results]


def test_dit_two_replicas_of_four_ranks_match_one_process():
    args = _args((6, 6), 0, 2, "team", cp=4)  # 9 tokens: padded to 16
    results = run_ranks(8, _train_case, args)
    _check_parity(results, args, replicas=2)
    # replicas draw different samples: their loss parts differ, the mean is the reference
    b0, b1 = (ReplicaBatches(args.model, args.seed, d, 2, torch.float64).next() for d in (0, 1))
    assert not torch.equal(b0["noise"], b1["noise"])


def _on_off_case(rank, world, args):
    """One forward of the same batch with StarTrail on, then off (attention unwrapped: each
    rank's SDPA over its own tokens only), gathered to the whole token sequence."""
    from startrail_megatron.dit import parallelize_dit, unwrap_attention
    from startrail_megatron.dit.loop import build_model

    model = build_model(args)
    handle = parallelize_dit(model, groups_for(2), kernel="torch")
    batch = ReplicaBatches(args.model, args.seed, 0, 2, torch.float64).next()
    on = handle.tokens.gather(model(batch["x"], batch["t"], batch["y"], batch["context"]))
    for block in model.blocks:
        unwrap_attention(block.attn)
    off = handle.tokens.gather(model(batch["x"], batch["t"], batch["y"], batch["context"]))
    return on, off


@pytest.mark.parametrize("text", [0, 3])
def test_parity_fails_when_attention_sees_only_local_tokens(text):
    """The same forward with StarTrail switched off differs from one device, with it on it
    matches: the parity checks above can fail."""
    args = _args((6, 10), text)  # 15 tokens on P = 4: padded
    from startrail_megatron.dit.loop import build_model

    model = build_model(args)
    batch = ReplicaBatches(args.model, args.seed, 0, 2, torch.float64).next()
    want = model(batch["x"], batch["t"], batch["y"], batch["context"]).detach()
    for on, off in run_ranks(4, _on_off_case, args):
        assert (on - want).abs().max() <= 1e-12 * want.abs().max()
        assert (off - want).abs().max() > 1e-3 * want.abs().max()


def _rng_case(rank, world, per_rank):
    g = torch.Generator().manual_seed(100 + (rank if per_rank else 0))
    noise = torch.randn(2, 3, 4, 4, generator=g)
    t = torch.tensor([5, 7])
    try:
        check_replicated(groups_for(2).cp_group, noise=noise, timesteps=t)
        return None
    except ValueError as e:
        return str(e)


def test_rng_check_fails_when_ranks_draw_different_noise():
    assert run_ranks(4, _rng_case, False) == [None] * 4
    for msg in run_ranks(4, _rng_case, True):
        assert msg is not None and "disagree on noise (" in msg and "timesteps (" not in msg
        assert "per data-parallel replica" in msg


class _LastStepDiffers:
    """A replica's batches, except that on CP rank 1 ``field`` differs from the other ranks'
    at the last step only; ``drawn`` counts the steps drawn."""

    def __init__(self, args: TrainArgs, rank: int, field: str):
        self.batches = ReplicaBatches(
            args.model, args.seed, 0, args.micro_batch_size, torch.float64
        )
        self.rank, self.field, self.classes, self.drawn = rank, field, args.model.num_classes, 0

    def next(self) -> dict:
        batch = self.batches.next()
        self.drawn += 1
        if self.drawn == STEPS and self.rank == 1:
            x = batch[self.field]
            batch[self.field] = (x + 1) % self.classes if self.field == "y" else x + 1
        return batch


def _last_step_case(rank, world, args: TrainArgs):
    out = {}
    for field, name in (("noise", "noise"), ("t", "timesteps"), ("y", "labels"),
                        ("context", "context"), ("x", "images")):  # fmt: skip
        batches = _LastStepDiffers(args, rank, field)
        try:
            run_training(args, groups=groups_for(1), batches=batches, log=lambda *_: None)
            out[name] = (None, batches.drawn)
        except ValueError as e:
            out[name] = (str(e), batches.drawn)
    return out


def test_trainer_checks_the_ranks_draws_every_step():
    """The trainer checks every step that the ranks of a replica drew the same noise, and
    the parallelized model that its inputs are the same (images, timesteps, labels, text:
    ``check_replicated``): one that differs on one rank at the last step only stops the
    training there, on every rank, naming what differs (images were not checked)."""
    args = _args((4, 4), 2)
    for out in run_ranks(2, _last_step_case, args):
        for name, (msg, drawn) in out.items():
            assert msg is not None and f"disagree on {name} (" in msg, (name, msg)
            assert drawn == STEPS, (name, drawn)


def _misuse_case(rank, world):
    groups = groups_for(2)
    tokens = TokenSharding(groups)
    x = torch.randn(2, 15, 8)  # 15 tokens on P = 4: padded to 16
    local = tokens.shard(x)
    sdpa = StarTrailSDPA(groups, tokens, joint_tokens=0, kernel="torch")
    q = local.view(2, 4, 2, 4).transpose(1, 2)  # [B, H, s_local, D]

    class Fused(torch.nn.Module):  # calls attention by another name: must be refused
        def forward(self, q):
            return torch.ops.aten.scaled_dot_product_attention(q, q, q)

    class Plain(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q)

    fused = wrap_attention(Fused(), sdpa)
    plain = wrap_attention(Plain(), sdpa)
    out = plain(q)
    gathered = tokens.gather(out.transpose(1, 2).reshape(2, -1, 8))
    errs = value_errors(
        {
            "mask": lambda: sdpa(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool)),
            "causal": lambda: sdpa(q, q, q, is_causal=True),
            "length": lambda: sdpa(q[:, :, :3], q[:, :, :3], q[:, :, :3]),
            "joint": lambda: StarTrailSDPA(groups, tokens, joint_tokens=-1),
            "again": lambda: wrap_attention(plain, sdpa),
        }
    )
    fused_err = value_errors({"fused": lambda: fused(q)}, RuntimeError)["fused"]
    return errs, fused_err, gathered, sdpa.calls, F.scaled_dot_product_attention is sdpa, x


def test_wrapper_refuses_what_it_cannot_run_and_restores_sdpa():
    results = run_ranks(4, _misuse_case)
    for errs, fused_err, gathered, calls, still_swapped, _ in results:
        assert "attn_mask" in errs["mask"] and "is_causal" in errs["causal"]
        assert "s_local" in errs["length"] and "joint_tokens" in errs["joint"]
        assert "already wrapped" in errs["again"]
        assert "did not run" in fused_err
        assert not still_swapped and calls >= 1
        assert gathered.shape == (2, 15, 8)
    # every rank gathers the same full output, equal to one device's attention
    torch.manual_seed(0)
    for r in results[1:]:
        assert torch.equal(r[2], results[0][2])
    x = results[0][5]
    assert all(torch.equal(r[5], x) for r in results)  # every rank sharded the same tokens
    full = x.view(2, 15, 2, 4).transpose(1, 2)  # [B, H, 15, D]: no padding on one device
    want = F.scaled_dot_product_attention(full, full, full).transpose(1, 2).reshape(2, 15, 8)
    for r in results:
        assert (r[2] - want).abs().max() <= 1e-5 * want.abs().max(), (r[2] - want).abs().max()


def test_train_args_refuse_bad_settings_by_name():
    errs = value_errors(
        {
            "dtype": lambda: replace(_args(), dtype="fp8"),
            "placement": lambda: replace(_args(), placement="star"),
            "steps": lambda: replace(_args(), steps=0),
            "orf": lambda: replace(_args(), own_rows_first="sometimes"),
            "orf_ds": lambda: replace(_args(), own_rows_first="on", deepspeed_config="ds.json"),
            "fp64_ds": lambda: replace(_args(), dtype="fp64", deepspeed_config="ds.json"),
            "patch": lambda: DiTConfig(height=7, width=8, patch_size=2),
            "heads": lambda: DiTConfig(hidden_size=30, num_heads=4),
        }
    )
    assert "--dtype" in errs["dtype"] and "fp64" in errs["dtype"]
    assert "--placement" in errs["placement"]
    assert "--steps" in errs["steps"]
    assert "--own-rows-first='sometimes'" in errs["orf"] and "'auto'" in errs["orf"]
    assert "startrail.own_rows_first" in errs["orf_ds"]
    assert "--dtype fp64 with --deepspeed-config" in errs["fp64_ds"]
    replace(_args(), own_rows_first="AUTO", deepspeed_config="ds.json", dtype="fp32")  # any case
    assert "patch_size" in errs["patch"] and "num_heads" in errs["heads"]


def test_cli_spawns_ranks_and_trains(tmp_path):
    """``python -m startrail_megatron.dit.train --nproc 2``: uneven MMDiT tokens, a JSON log."""
    import json

    from startrail_megatron.dit import train

    log = tmp_path / "log.json"
    train.main(
        ["--nproc", "2", "--steps", "3", "--image-size", "6", "--text-tokens", "2",
         "--hidden-size", "16", "--log-interval", "1", "--json-log", str(log)]
    )  # fmt: skip
    out = json.loads(log.read_text())
    assert len(out["losses"]) == 3 and all(x > 0 for x in out["losses"])
    assert out["args"]["model"]["text_tokens"] == 2 and len(out["log"]) == 3
