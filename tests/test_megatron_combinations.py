"""Parallel layouts users run, against one rank without CP: TP = 2 with
C = 2, DP x CP x TP on 8 ranks, P = 8 with C = 2; the 2-D split: CP = 8 with
U = 2 and C = 2, TP = 2 x CP = 4 with U = 2.

Each run trains 3 SGD steps with the entry point's own pieces and saves its final
distributed checkpoint. Checked: the losses (1e-5), the final parameters of the whole
model read back from the checkpoint against the one-rank run's (1e-5 of each tensor's
largest entry), every rank's own parameter shards bitwise equal to those of every other
rank of its tensor-parallel rank (the CP and DP replicas stayed in step), and the proof
that StarTrail ran (``megatron_common``).
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
from megatron_common import assert_startrail_ran, startrail_proof  # noqa: E402

from startrail_megatron.megatron import training as T  # noqa: E402

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
    "--micro-batch-size", "2", "--mock-data", "--optimizer", "sgd", "--lr", "1e-2",
    "--make-vocab-size-divisible-by", "64",  # the same padded vocabulary (128) at TP = 2
]  # fmt: skip
STEPS, TOL = 3, 1e-5


def _run(rank, world, argv, ckpt):
    from megatron.core import parallel_state as ps

    args = T.parse_args(argv)
    T.initialize(args)
    try:
        model = T.build_model(args)
        opt = T.build_optimizer(args, model)
        batches = T.global_batches(args, T.build_dataset(args, 8 * args.global_batch_size))
        losses = []
        for _ in range(STEPS):
            losses.append(T.forward_backward(args, model, next(batches)))
            T.optimizer_step(model, opt, args.clip_grad)
        T.save_checkpoint(ckpt, model, STEPS)
        local = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        tp_rank = ps.get_tensor_model_parallel_rank()
        return losses, local, tp_rank, startrail_proof(args, model, STEPS)
    finally:
        T.teardown()


def _checkpoint_params(ckpt) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt / f"iter_{STEPS:07d}"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "_extra" not in k}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The one-rank runs, each made once for the module: the reference of a global batch
    size (``reference(gbs)``) and the parameters at initialisation (``init()``)."""
    tmp, refs, init = tmp_path_factory.mktemp("one_rank"), {}, []

    def reference(gbs: int):
        if gbs not in refs:
            ckpt = tmp / f"reference{gbs}"
            argv = BASE + ["--global-batch-size", str(gbs)]
            losses = run_ranks(1, _run, argv, str(ckpt))[0][0]
            refs[gbs] = losses, _checkpoint_params(ckpt)
        return refs[gbs]

    def at_init():
        if not init:
            ckpt = tmp / "init"
            run_ranks(1, _init, str(ckpt))
            init.append(_checkpoint_params(ckpt))
        return init[0]

    return reference, at_init


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, cp, team, placement, ulysses",
    [
        (2, 4, 2, "team", 1),
        (2, 2, 1, "team", 1),
        (1, 8, 2, "ring", 1),
        (1, 8, 2, "team", 2),  # the 2-D split: KV heads sharded over U = 2
        (2, 4, 1, "team", 2),  # TP = 2 x the 2-D split: one KV head per TP rank, repeated
    ],
    ids=["tp2-cp4-c2", "dp2-cp2-tp2-ring", "cp8-c2-ring-placement", "cp8-u2-c2", "tp2-cp4-u2"],
)
def test_layout_on_8_ranks_matches_one_rank(tmp_path, one_rank, tp, cp, team, placement, ulysses):
    dp = 8 // (tp * cp)
    argv = BASE + ["--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp)]
    argv += ["--context-parallel-impl", "startrail", "--startrail-team-size", str(team)]
    argv += ["--startrail-placement", placement, "--global-batch-size", str(2 * dp)]
    argv += ["--startrail-ulysses-size", str(ulysses)]
    reference, at_init = one_rank
    ref_losses, ref_params = reference(2 * dp)
    ckpt = tmp_path / "run"
    results = run_ranks(8, _run, argv, str(ckpt))
    by_tp: dict[int, dict] = {}
    for losses, local, tp_rank, proof in results:
        assert_startrail_ran(proof)
        assert len(losses) == len(ref_losses) == STEPS
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= TOL * abs(b), (losses, ref_losses)
        first = by_tp.setdefault(tp_rank, local)  # the replicas of one TP rank: bitwise equal
        assert all(torch.equal(first[k], v) for k, v in local.items())
    assert sorted(by_tp) == list(range(tp))
    got = _checkpoint_params(ckpt)
    assert got.keys() == ref_params.keys() and got
    for k, r in ref_params.items():
        assert got[k].shape == r.shape, k
        err = ((got[k] - r).abs().max() / r.abs().max()).item()
        assert err <= TOL, f"{k}: {err:.2e}"
    # the steps moved the parameters far beyond the tolerance: the comparison can fail
    init = at_init()
    assert (
        max(((ref_params[k] - init[k]).abs().max() / init[k].abs().max()).item() for k in init)
        > 1e3 * TOL
    )


def _run_on_two_hosts(rank, world, argv, ckpt):
    """``_run`` with this rank on emulated host ``(rank // 2) % 2`` (tensor-parallel pairs
    alternate between two hosts, so a CP group of TP = 2 alternates too), and the placement
    map its StarTrail groups ran."""
    import socket

    from startrail_megatron.megatron.arguments import placement_shape
    from startrail_megatron.planner.placement import auto_map

    real = socket.gethostname
    socket.gethostname = lambda: f"host{(rank // 2) % 2}"
    try:
        out = _run(rank, world, argv, ckpt)
    finally:
        socket.gethostname = real
    # CP rank i of a TP = 2 group is global rank 2 i (+ its TP rank): host i % 2
    return *out, auto_map((0, 1, 0, 1), 2, placement_shape(T.parse_args(argv)))


def test_placement_auto_on_two_hosts_matches_one_rank(tmp_path, one_rank):
    """``--startrail-placement auto`` with TP = 2, CP = 4 on two emulated hosts (each CP
    group's ranks alternate between them): every rank runs the map the planner computes for
    those nodes and the flags' attention call (not a named placement), and the losses and
    parameters match one rank."""
    argv = BASE + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "4"]
    argv += ["--context-parallel-impl", "startrail", "--startrail-team-size", "2"]
    argv += ["--startrail-placement", "auto", "--global-batch-size", "2"]
    reference, _ = one_rank
    ref_losses, ref_params = reference(2)
    ckpt = tmp_path / "run"
    results = run_ranks(8, _run_on_two_hosts, argv, str(ckpt))
    for losses, _local, _tp, proof, want in results:
        assert_startrail_ran(proof)
        assert want != tuple(range(4))
        assert proof["placement"] == want, (proof["placement"], want)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= TOL * abs(b), (losses, ref_losses)
    got = _checkpoint_params(ckpt)
    for k, r in ref_params.items():
        err = ((got[k] - r).abs().max() / r.abs().max()).item()
        assert err <= TOL, f"{k}: {err:.2e}"


def _init(rank, world, ckpt):
    args = T.parse_args(BASE)
    T.initialize(args)
    try:
        T.save_checkpoint(ckpt, T.build_model(args), STEPS)
    finally:
        T.teardown()
