"""Hybrid (per-batch) context parallelism on StarTrail (``--hybrid-context-parallel``).

The entry point's pieces on 4 ranks (DP 4 x CP 1, as megatron-core's hybrid CP is
configured; its sub-groups of 2 and 4 ranks and one rank alone), one global micro-batch
whose documents differ in length (one of 256 tokens, four of 128, four of 64): each scheduler (ours on
the planner's cost model, megatron-core's ``BalancedCPScheduler``) places the long
document on a sub-group of ranks, and the loss and every parameter's gradient equal CP = 1
on one rank (the packed documents of the same rows) to 1e-5. Proof that the sub-groups
ran: the 2-rank sub-group's StarTrail state saw the local tokens of each packed bin (the
long document with another, in one THD forward, RoPE rotated over the sub-group) and sent
bytes; with the sub-group ignored (the attention on the model's CP group of one rank) the
call is refused by name. Refusals: a sub-sample whose RoPE megatron-core slices over another group, and the
flags that cannot combine.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
)
import megatron.core  # noqa: E402, F401  (imported once here, before the ranks fork)
from harness import MultiRankError, run_ranks  # noqa: E402

from startrail_megatron.megatron import training as T  # noqa: E402
from startrail_megatron.megatron.training.hybrid import (  # noqa: E402
    document_lengths,
    model_team_sizes,
)
from startrail_megatron.schedule.batch import (  # noqa: E402
    document_bins,
    rank_runs,
    runs_from_rounds,
)
from startrail_megatron.schedule.layout import team_size_within  # noqa: E402

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "256",
    "--mock-data", "--optimizer", "sgd", "--reset-attention-mask", "--eod-mask-loss",
    "--context-parallel-impl", "startrail",
]  # fmt: skip
HYBRID = ["--hybrid-context-parallel", "--startrail-team-size", "2", "--micro-batch-size", "1",
          "--max-seqlen-per-dp-cp-rank", "128"]  # fmt: skip
TOL = 1e-5


def _micro_batch(eod: int) -> dict:
    """4 rows of 256: one document, two rows of two documents of 128, one of four of 64."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, eod, (4, 257), generator=g)
    tokens[1:3, 127] = eod
    tokens[3, 63::64] = eod
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(4, 256),
        "position_ids": torch.arange(256).expand(4, 256).contiguous(),
    }


def _grads(model):
    model.finish_grad_sync()
    out = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    model.zero_grad_buffer()
    return out


def _run(rank, world, argv, schedulers, ignore_subgroup=False):
    from startrail_megatron.megatron import attention as A
    from startrail_megatron.megatron import registry

    args = T.parse_args(argv)
    T.initialize(args)
    saved = A.subgroup_state
    try:
        model = T.build_model(args)
        mb = _micro_batch(T.eod_id(args))
        out = {}
        for name in schedulers:
            args.startrail_batch_scheduler = name
            args.max_seqlen_per_dp_cp_rank = CAPS[name]
            if ignore_subgroup:  # every sub-sample on the model's CP group instead
                A.subgroup_state = lambda group, k: registry.get_startrail_state(
                    model.module.decoder.layers[0].self_attention.core_attention.cp_group
                )
            loss = T.forward_backward(args, model, [mb])
            A.subgroup_state = saved
            proof = None
            if args.hybrid_context_parallel:
                st = registry.subgroup_state(registry.subgroup_group(2), 2)
                alone = registry.subgroup_state(registry.subgroup_group(1), 1)
                proof = (sorted(st.local_lengths), st.ledger.bytes(), registry.hybrid_team_sizes(),
                         dict(alone.calls_by_length))  # fmt: skip
                for state in (st, alone):
                    state.local_lengths.clear()
                    state.calls_by_length.clear()
                    state.ledger.clear()
            out[name] = (loss, _grads(model), proof)
        return out
    finally:
        A.subgroup_state = saved
        T.teardown()


def _close(got, ref):
    loss, grads, _ = got
    ref_loss, ref_grads, _ = ref
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
    worst = max(((grads[n] - r).abs().max() / r.abs().max()).item() for n, r in ref_grads.items())
    return worst


def _slow_cluster(tmp_path) -> list[str]:
    """A CPU-like cluster (slow attention and links, no overlap) on whose cost model a
    sub-group for the long document pays at these tiny sizes (on an H100 cluster every
    document would run alone)."""
    import dataclasses
    import json

    from startrail_megatron.planner.cluster import CLUSTER_PRESETS

    spec = CLUSTER_PRESETS["h100-ib"].with_(
        gpus_per_node=4, num_nodes=1, attn_flops=1e8, intra_bw=1e8, overlap=False
    )
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(dataclasses.asdict(spec)))
    return ["--startrail-batch-cluster", str(path)]


CAPS = {"startrail": 384, "megatron": 128}
"""--max-seqlen-per-dp-cp-rank per scheduler: megatron-core's sizes the long document's
sub-group from it (2 ranks for 256 tokens); ours leaves room to pack several documents."""
DOCS = [256, 128, 128, 128, 128, 64, 64, 64, 64]
"""``_micro_batch``'s documents, in order."""


def _docs_on(argv: list[str], scheduler: str, rank: int, k: int = 1) -> list[int]:
    """The documents ``scheduler`` runs on ``rank``'s sub-group of ``k`` ranks under the
    ranks' ``argv``, in the run order (the schedule the ranks computed: a pure function of
    the lengths and flags)."""
    from startrail_megatron.megatron.training import hybrid

    args = T.parse_args(argv + ["--nproc", "4", "--startrail-batch-scheduler", scheduler])
    args.max_seqlen_per_dp_cp_rank = CAPS[scheduler]
    schedule = hybrid._ours if scheduler == "startrail" else hybrid._megatrons
    runs = rank_runs(schedule(args, DOCS, 4, {1: 1, 2: 1, 4: 2}), rank)
    return [d for d, size, _ in runs if size == k]


def test_hybrid_context_parallel_matches_cp1_with_both_schedulers(tmp_path):
    ref = run_ranks(1, _run, BASE + ["--micro-batch-size", "4"], ["startrail"])[0]["startrail"]
    hybrid = BASE + HYBRID + _slow_cluster(tmp_path)
    got = run_ranks(4, _run, hybrid, ["startrail", "megatron"])
    packed, packed2 = 0, 0
    for rank, runs in enumerate(got):
        for name, run in runs.items():
            assert _close(run, ref) <= TOL, (rank, name)
            lengths, sent, teams, alone_calls = run[2]
            assert teams == {1: 1, 2: 1, 4: 2}
            if rank < 2:  # the long document ran on the 2-rank sub-group of ranks 0 and 1,
                # with the sub-group's other documents packed in THD forwards (bins within
                # --max-seqlen-per-dp-cp-rank): each call's local tokens those of a bin
                docs2 = _docs_on(hybrid, name, rank, 2)
                bins2 = document_bins(docs2, DOCS, 2, CAPS[name])
                assert 0 in docs2 and sent > 0, (rank, name, docs2, sent)
                assert set(lengths) == {sum(DOCS[d] // 2 for d in b) for b in bins2}, lengths
                packed2 += sum(len(b) > 1 for b in bins2)
            # a rank's one-rank documents ran packed, one forward per bin within
            # --max-seqlen-per-dp-cp-rank: 2 layers' calls per forward
            docs = _docs_on(hybrid, name, rank)
            bins = document_bins(docs, DOCS, 1, CAPS[name])
            assert sum(alone_calls.values()) == 2 * len(bins), (rank, name, alone_calls, docs)
            assert {sum(DOCS[d] for d in b) for b in bins} == set(alone_calls), (rank, name)
            packed += sum(len(b) > 1 for b in bins)
    assert packed  # some bin held two documents: the packed call ran
    assert packed2  # and some 2-rank bin (with RoPE over the sub-group: exact above)
    # --startrail-team-size auto: each sub-group size's team size is the cost model's pick
    # (on this slow cluster ring, C = 1, for 4 ranks, where the cap rule gives 2)
    at = hybrid.index("--startrail-team-size") + 1
    auto = [*hybrid[:at], "auto", *hybrid[at + 1 :]]
    picked = model_team_sizes(T.parse_args(auto + ["--nproc", "4"]))
    assert picked == {2: 1, 4: 1} != {k: team_size_within(k, 2) for k in picked}
    for rank, runs in enumerate(run_ranks(4, _run, auto, ["startrail"])):
        assert _close(runs["startrail"], ref) <= TOL, rank
        assert runs["startrail"][2][2] == {1: 1, **picked}, (rank, runs["startrail"][2])
    # the sub-group ignored (each call on the model's CP group, this rank alone): the packed
    # boundaries of the 2-rank bin do not fit one rank's tokens, refused by name on ranks
    # 0 and 1 (not computed as if the long document's halves were whole documents)
    with pytest.raises(MultiRankError, match="cu_seqlens_padded ends at 384"):
        run_ranks(4, _run, hybrid, ["startrail"], True)


def test_hybrid_packs_documents_where_the_models_cp_group_is_not_the_sub_group(tmp_path):
    """DP 2 x CP 2 (the model's CP group: 2 ranks): every sub-group's documents still run
    packed in THD forwards, the one-rank ones too (RoPE rotated over the rank alone, by
    ``rope_over``, not over the model's 2 CP ranks), with CP = 1's loss and every gradient
    to 1e-5; before, a one-rank document here ran in its own ``sbhd`` forward."""
    ref = run_ranks(1, _run, BASE + ["--micro-batch-size", "4"], ["startrail"])[0]["startrail"]
    argv = BASE + HYBRID + _slow_cluster(tmp_path)
    at = argv.index("--micro-batch-size") + 1
    argv = [*argv[:at], "2", *argv[at + 1 :], "--context-parallel-size", "2"]
    packed = 0
    for rank, runs in enumerate(run_ranks(4, _run, argv, ["startrail"])):
        assert _close(runs["startrail"], ref) <= TOL, rank
        alone_calls = runs["startrail"][2][3]
        bins = document_bins(_docs_on(argv, "startrail", rank), DOCS, 1, CAPS["startrail"])
        assert {sum(DOCS[d] for d in b) for b in bins} == set(alone_calls), (rank, alone_calls)
        packed += sum(len(b) > 1 for b in bins)
    assert packed


def test_rank_runs_share_one_order():
    placed = [(0, 2, 0), (3, 1, 0), (1, 4, 0), (2, 1, 1), (4, 2, 2)]
    assert rank_runs(placed, 0) == [(1, 4, 0), (0, 2, 0), (3, 1, 0)]
    assert rank_runs(placed, 1) == [(1, 4, 0), (0, 2, 0), (2, 1, 1)]
    assert rank_runs(placed, 3) == [(1, 4, 0), (4, 2, 2)]
    rounds = [[[0], [0], [1], [2]], [[3], [3], [3], [3]]]  # megatron-core's rounds, per rank
    assert runs_from_rounds(rounds) == [(0, 2, 0), (1, 1, 2), (2, 1, 3), (3, 4, 0)]
    with pytest.raises(ValueError, match=r"document 0 on ranks \[1, 2\]"):
        runs_from_rounds([[[], [0], [0], []]])  # not an aligned pair: no group for it
    with pytest.raises(ValueError, match=r"aligned blocks of \[1, 2\]"):
        runs_from_rounds(rounds, {1: 1, 2: 1})
    eod = 9
    assert document_lengths(torch.tensor([[1, 9, 2, 2], [9, 9, 1, 1]]), eod) == [2, 2, 1, 1, 2]


def test_team_size_within():
    assert [team_size_within(k, 2) for k in (1, 2, 4, 8, 16)] == [1, 1, 2, 2, 2]
    assert [team_size_within(k, 4) for k in (4, 8, 16, 32)] == [2, 2, 4, 4]
    with pytest.raises(ValueError, match="team size cap"):
        team_size_within(4, 0)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--startrail-team-size", "2", "--startrail-placement", "auto"],
         "--startrail-placement auto"),
        (["--startrail-team-size", "1", "--startrail-batch-scheduler", "megatron"],
         "needs --max-seqlen-per-dp-cp-rank"),
        (["--startrail-team-size", "2", "--startrail-batch-cluster", "h200-nowhere"],
         "--startrail-batch-cluster 'h200-nowhere': neither a preset (['a100-eth'"),
    ],
)  # fmt: skip
def test_hybrid_flags_that_cannot_combine_fail_at_parsing(flags, needle, capsys):
    argv = BASE + ["--hybrid-context-parallel", "--nproc", "4", "--micro-batch-size", "1"]
    with pytest.raises(SystemExit):
        T.parse_args(argv + flags)
    assert needle in capsys.readouterr().err


def test_hybrid_flags_without_hybrid_context_parallel_are_refused(capsys):
    """They would be ignored (a bad cluster name too): each named."""
    argv = BASE + ["--nproc", "4", "--context-parallel-size", "4"]
    argv += ["--startrail-batch-scheduler", "megatron", "--startrail-batch-cluster", "nowhere"]
    with pytest.raises(SystemExit):
        T.parse_args(argv + ["--max-seqlen-per-dp-cp-rank", "7"])
    err = capsys.readouterr().err
    assert (
        "--startrail-batch-scheduler, --startrail-batch-cluster, --max-seqlen-per-dp-cp-rank "
        "without --hybrid-context-parallel would be ignored" in err
    ), err
    args = T.parse_args(BASE + ["--nproc", "4", "--hybrid-context-parallel"])
    assert (args.startrail_batch_scheduler, args.startrail_batch_cluster) == (
        "startrail", "h100-ib"
    )  # fmt: skip


def test_hybrid_needs_documents_and_a_power_of_two(capsys):
    argv = [a for a in BASE if a != "--reset-attention-mask"]
    with pytest.raises(SystemExit):
        T.parse_args(argv + ["--hybrid-context-parallel", "--nproc", "4"])
    assert "give --reset-attention-mask" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.parse_args(BASE + ["--hybrid-context-parallel", "--nproc", "6"])
    assert "power-of-two number of DP x CP ranks" in capsys.readouterr().err


def _refusals(rank, world):
    from megatron.core.packed_seq_params import PackedSeqParams

    from startrail_megatron.megatron import registry

    args = T.parse_args(BASE + HYBRID + ["--context-parallel-size", "2"])
    T.initialize(args)
    try:
        model = T.build_model(args)
        attn = model.module.decoder.layers[0].self_attention.core_attention
        q = torch.randn(64, 1, 4, 16)
        k = v = torch.randn(64, 1, 2, 16)
        alone = registry.subgroup_group(1)

        def psp(fmt, size, group, n=64):
            c = torch.tensor([0, n], dtype=torch.int32)
            return PackedSeqParams(
                qkv_format=fmt, cu_seqlens_q=c, cu_seqlens_kv=c, cu_seqlens_q_padded=c,
                cu_seqlens_kv_padded=c, max_seqlen_q=n, max_seqlen_kv=n, local_cp_size=size,
                cp_group=group,
            )  # fmt: skip

        out = {}
        cases = {
            "no group": psp("sbhd", 1, None),
            "thd alone": psp("thd", 1, alone),
            "size": psp("sbhd", 2, alone),
            "length": psp("sbhd", 1, alone, 96),
        }
        for name, p in cases.items():
            try:
                attn(q, k, v, None, packed_seq_params=p)
                out[name] = None
            except (NotImplementedError, ValueError) as e:
                out[name] = (type(e).__name__, str(e))
        assert attn(q, k, v, None, packed_seq_params=psp("sbhd", 1, alone)).shape == (64, 1, 64)
        # 'thd' on a sub-group is served while pg_collection.cp is that sub-group (RoPE was
        # rotated over it), as the entry point's rope_over sets it for a forward
        from startrail_megatron.megatron.training.hybrid import rope_over

        with rope_over(model, alone):  # thd: [t, heads, head_dim]
            thd = attn(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=psp("thd", 1, alone))
            out["thd alone, rope over it"] = tuple(thd.shape)
        out["cp restored"] = attn._pg_collection.cp is attn.cp_group
        return out
    finally:
        T.teardown()


def test_hybrid_calls_it_cannot_serve_are_refused_by_name():
    """On CP = 2: a one-rank sub-sample without a group (megatron-core would slice its RoPE
    over the 2 CP ranks), one in 'thd' on another group than the model's CP group (RoPE's
    THD slicing is over the CP group), a local_cp_size its group does not have, and a
    sub-sample whose cu_seqlens disagree with its local length. The 'thd' one is served
    while ``rope_over`` has set pg_collection.cp to its group, which is restored after."""
    for out in run_ranks(2, _refusals):
        assert out["no group"][0] == "NotImplementedError"
        assert "without packed_seq_params.cp_group" in out["no group"][1]
        assert out["thd alone"][0] == "NotImplementedError"
        assert "RoPE's THD context-parallel slicing" in out["thd alone"][1]
        assert out["size"] == ("ValueError", out["size"][1])
        assert "local_cp_size 2 but its cp_group has 1 ranks" in out["size"][1]
        assert out["length"][0] == "NotImplementedError" and "[0, 64]" in out["length"][1]
        assert out["thd alone, rope over it"] == (64, 64) and out["cp restored"]


def test_packed_boundaries_read_megatron_016s_one_row_cu_seqlens():
    """megatron-core 0.16's SFT batches give cu_seqlens as [1, n] (0.19 squeezes them):
    read as the same boundaries; any other 2-D shape is refused by name."""
    from types import SimpleNamespace

    from startrail_megatron.megatron.attention import _packed_boundaries

    def psp(t):
        return SimpleNamespace(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t,
                               cu_seqlens_q_padded=t, cu_seqlens_kv_padded=t)  # fmt: skip

    flat = torch.tensor([0, 8, 24], dtype=torch.int32)
    assert _packed_boundaries(psp(flat[None]), 24) == _packed_boundaries(psp(flat), 24)
    assert _packed_boundaries(psp(flat), 24) == ([0, 8, 24], [0, 8, 24])
    with pytest.raises(ValueError, match="a 1-D tensor"):
        _packed_boundaries(psp(flat.expand(2, 3)), 24)


def test_our_scheduler_keeps_the_entry_points_token_cap():
    """``--max-seqlen-per-dp-cp-rank`` binds ours too (one call per document: each
    document's share per rank, padding counted); a document that no sub-group holds within
    it is refused naming the flag. The layer is priced with the run's GPT (``batch_model``)."""
    from startrail_megatron.megatron.training import hybrid
    from startrail_megatron.schedule.batch import rank_doc_tokens

    args = T.parse_args(BASE + HYBRID + ["--nproc", "4"])
    assert hybrid.batch_model(args).ffn_hidden == 4 * 64
    sizes = {1: 1, 2: 1, 4: 2}
    lengths = [256, 128, 128, 128, 128, 64, 64, 64, 64]
    runs = hybrid._ours(args, lengths, 4, sizes)
    assert sorted(d for d, _, _ in runs) == list(range(len(lengths)))
    assert all(rank_doc_tokens(lengths[d], k) <= 128 for d, k, _ in runs)
    assert any(k > 1 for d, k, _ in runs if d == 0)  # 256 tokens do not fit one rank
    with pytest.raises(ValueError, match="--max-seqlen-per-dp-cp-rank 128: max_tokens_per_rank"):
        hybrid._ours(args, [1024, 64], 4, sizes)


def test_hybrid_team_sizes_are_checked_by_name():
    """A team size per sub-group size must cover every size and fit each; ``auto`` under
    hybrid CP needs them (our entry point passes the model's), before anything is made."""
    import argparse

    from startrail_megatron.megatron import hooks
    from startrail_megatron.megatron.arguments import install_from_args
    from startrail_megatron.megatron.registry import check_hybrid_team_sizes

    check_hybrid_team_sizes({2: 1, 4: 2, 8: 2}, [2, 4, 8])
    for sizes, needle in (({2: 1, 4: 2}, "missing [8]"), ({2: 2, 4: 2, 8: 2}, "not fitting {2: 2}"),
                          ({2: 1, 4: True, 8: 2}, "not fitting {4: True}")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(needle)):
            check_hybrid_team_sizes(sizes, [2, 4, 8])
    with pytest.raises(ValueError, match=re.escape("not fitting {4: 4}")):
        hooks.install(2, hybrid_team_sizes={2: 1, 4: 4})
    assert hooks.installed_config() is None
    ns = argparse.Namespace(
        context_parallel_impl="startrail", startrail_team_size="auto", startrail_placement="team",
        hybrid_context_parallel=True, startrail_autotune_iters=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="auto with --hybrid-context-parallel"):
        install_from_args(ns)
    assert hooks.installed_config() is None


def test_the_banner_names_the_team_size_each_sub_group_size_gets_under_auto(tmp_path, capsys):
    from startrail_megatron.megatron.pretrain_gpt import _banner

    argv = BASE + HYBRID + _slow_cluster(tmp_path) + ["--nproc", "4"]
    at = argv.index("--startrail-team-size") + 1
    _banner(T.parse_args([*argv[:at], "auto", *argv[at + 1 :]]))
    assert (
        "team size auto, placement team (per sub-group size, the cost model's: {2: 1, 4: 1})"
        in (capsys.readouterr().out)
    )
    _banner(T.parse_args(argv))
    assert "per sub-group size" not in capsys.readouterr().out
