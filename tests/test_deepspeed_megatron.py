"""A megatron-core GPTModel with StarTrail trained by DeepSpeed (ZeRO 0-3, P = 4, C = 1 and 2,
DP = 1 and 2) matches a single-rank Megatron run without CP or DeepSpeed (losses and every
rank's final parameters, fp32, 1e-5), with gradient clipping on."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
)
pytest.importorskip("megatron.core")
from common import assert_messages, value_errors  # noqa: E402
from ds_common import ds_config, rank_env  # noqa: E402  (sets DS_ACCELERATOR=cpu first)
from harness import run_ranks  # noqa: E402
from megatron_common import assert_startrail_ran, startrail_proof  # noqa: E402

import startrail_megatron.deepspeed as sds  # noqa: E402
from startrail_megatron.megatron import training as T  # noqa: E402

ARGV = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--untie-embeddings-and-output-weights",
]
LR, STEPS, CLIP = 0.1, 3, 1.0


def _batches(dp: int = 1):
    """STEPS global batches of ``dp`` sequences: (input_ids, position_ids, labels)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (dp, 33), generator=g)
        pos = torch.arange(32).expand(dp, 32)
        out.append((ids[:, :-1].contiguous(), pos, ids[:, 1:].contiguous()))
    return out


def _model(argv):
    from megatron.core.models.gpt import GPTModel

    args = T.parse_args(argv)
    T.initialize(args)
    return GPTModel(
        config=T.transformer_config(args),
        transformer_layer_spec=T.layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def _reference(rank, world, dp):
    model = _model(ARGV)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for ids, pos, labels in _batches(dp):
            loss = model(ids, pos, None, labels=labels).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        T.teardown()


def _deepspeed(rank, world, stage, team, dp, ulysses=1):

    import deepspeed
    from deepspeed.utils import groups as ds_groups

    rank_env(rank, world)
    argv = ARGV + ["--context-parallel-size", "4", "--context-parallel-impl", "startrail"]
    argv += ["--startrail-team-size", str(team), "--startrail-ulysses-size", str(ulysses)]
    model = _model(argv)
    try:
        from megatron.core import parallel_state as ps

        d = ps.get_data_parallel_rank()
        section = {"enabled": True, "sequence_parallel_size": 4, "team_size": team}
        cfg = ds_config(stage, dp, {**section, "ulysses_size": ulysses})
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        engine, _, _, _ = sds.initialize(model=model, optimizer=opt, config=cfg)
        losses = []
        for ids, pos, labels in _batches(dp):  # full sequences: the adapter shards them
            ids, pos, labels = ids[d : d + 1], pos[d : d + 1], labels[d : d + 1]  # this replica's
            per_token = engine(ids, pos, None, labels=labels)
            assert per_token.shape == (1, 32)  # gathered back to the whole sequence
            loss = per_token.mean()
            engine.backward(loss)
            engine.step()
            replicas = torch.tensor([loss.item()], dtype=torch.float64)
            torch.distributed.all_reduce(replicas, group=ps.get_data_parallel_group())
            losses.append(replicas.item() / dp)  # the global batch's loss
        proof = startrail_proof(T.parse_args(argv), engine.module, STEPS)
        try:  # position ids that jump inside a document: refused by name, never trained
            jump = torch.cat([torch.arange(5), torch.arange(10, 10 + pos.shape[1] - 5)])[None]
            engine(ids, jump, None, labels=labels)
            packed_error = None
        except ValueError as e:
            packed_error = str(e)
        params = list(engine.module.named_parameters())
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                final = {k: v.detach().clone() for k, v in params}
        else:
            final = {k: v.detach().clone() for k, v in params}
        del engine
        gc.collect()
        ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
        return losses, final, packed_error, proof
    finally:
        T.teardown()


@pytest.mark.parametrize(
    "stage, team, dp, ulysses",
    [
        (1, 2, 1, 1), (3, 2, 1, 1), (2, 1, 1, 1), (0, 2, 1, 1),
        pytest.param(1, 2, 2, 1, marks=pytest.mark.slow),
        (1, 1, 1, 2),  # the 2-D split: Ulysses over 2 ranks, StarTrail (ring) over 2
    ],
)  # fmt: skip
def test_megatron_gpt_through_deepspeed_matches_single_rank(stage, team, dp, ulysses):
    """Every rank's final parameters and the global batch's losses equal one rank's."""
    ref_losses, ref_params = run_ranks(1, _reference, dp)[0]
    runs = run_ranks(4 * dp, _deepspeed, stage, team, dp, ulysses)
    for losses, params, packed_error, proof in runs:
        assert_startrail_ran(proof)
        assert packed_error is not None and "position_ids[5] = 10 after 4" in packed_error
        assert len(losses) == len(ref_losses)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
        assert params.keys() == ref_params.keys()
        for k, ref in ref_params.items():
            err = ((params[k] - ref).abs().max() / ref.abs().max()).item()
            assert err <= 1e-5, f"{k}: {err:.2e}"


def _no_startrail_spec(rank, world):

    rank_env(rank, world)
    model = _model(ARGV)  # CP = 1, Megatron's own attention
    try:
        try:
            sds.initialize(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                config=ds_config(
                    1, 1, {"enabled": True, "sequence_parallel_size": 4, "team_size": 2}
                ),
            )
        except (ValueError, NotImplementedError) as e:
            return str(e)
        return None
    finally:
        T.teardown()


def test_megatron_gpt_mismatched_cp_size_is_refused():
    msg = run_ranks(4, _no_startrail_spec)
    assert all(m is not None and "startrail.sequence_parallel_size=4" in m for m in msg), msg


def _own_rows_first_mismatch(rank, world):

    rank_env(rank, world)
    argv = ARGV + ["--context-parallel-size", "4", "--context-parallel-impl", "startrail"]
    model = _model(argv + ["--startrail-team-size", "2", "--startrail-own-rows-first", "off"])
    try:
        st = {"enabled": True, "sequence_parallel_size": 4, "team_size": 2, "own_rows_first": "on"}
        try:
            sds.initialize(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                config=ds_config(1, 1, st),
            )
        except ValueError as e:
            return str(e)
        return None
    finally:
        T.teardown()


def test_megatron_gpt_own_rows_first_conflict_is_refused():
    """The Megatron groups were made with --startrail-own-rows-first off, the section says
    on: Megatron's attention reads the groups, so the key would be ignored; refused by name."""
    for msg in run_ranks(4, _own_rows_first_mismatch):
        assert msg is not None and "startrail.own_rows_first='on'" in msg, msg


def _dropped_settings(rank, world):
    """Settings plain DeepSpeed or the adapter would drop, each refused by name."""
    rank_env(rank, world)
    argv = ARGV + ["--context-parallel-size", "4", "--context-parallel-impl", "startrail"]
    model = _model(argv + ["--startrail-team-size", "2"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    section = {"enabled": True, "sequence_parallel_size": 4, "team_size": 2}

    def init(st):
        return sds.initialize(model=model, optimizer=opt, config=ds_config(1, 1, st))

    def with_mtp():  # its loss would be counted once per sequence rank
        model.config.mtp_num_layers = 1
        try:
            init(section)
        finally:
            model.config.mtp_num_layers = None

    try:
        out = value_errors(
            {  # StarTrail attention over CP 4, DeepSpeed told nothing of it
                "absent": lambda: init(None),
                "p1": lambda: init({"enabled": True, "sequence_parallel_size": 1}),
                "mtp": with_mtp,
            },
            (ValueError, NotImplementedError),
        )
        engine = init(section)[0]
        ids, pos, labels = _batches()[0]
        out |= value_errors({
            "positional": lambda e=engine: e(ids, pos, None, None, labels),  # labels 5th
            "decoder_input": lambda e=engine: e(ids, pos, None, decoder_input=torch.zeros(1)),
        })  # fmt: skip
        del engine
        gc.collect()
        return out
    finally:
        T.teardown()


def test_settings_the_megatron_path_would_drop_are_refused():
    want = {
        "absent": "runs StarTrail attention over Megatron's context_parallel_size=4, but the "
        "DeepSpeed config's startrail section is absent or disabled",
        "p1": "startrail section is at P = 1",
        "mtp": "mtp_num_layers=1 (multi-token prediction)",
        "positional": "by keyword (labels=...): got 5 positional ones",
        "decoder_input": "decoder_input (embeddings of the full sequence) is not supported",
    }
    for out in run_ranks(4, _dropped_settings):
        assert_messages(out, want)


# ---- packed documents in one row (position ids restarting per document) ----------------------
DOC_LENGTHS = [9, 3, 14, 1, 5]  # 32 tokens in one row


def _packed_docs():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 128, (n + 1,), generator=g) for n in DOC_LENGTHS]


def _packed_reference(rank, world):
    """Megatron's own attention at CP = 1 on each document on its own: per-token losses, and
    the parameters after one clipped SGD step on their mean."""
    model = _model(ARGV)
    try:
        per_token = torch.cat(
            [
                model(d[:-1][None], torch.arange(len(d) - 1)[None], None, labels=d[1:][None])[0]
                for d in _packed_docs()
            ]
        )
        per_token.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        torch.optim.SGD(model.parameters(), lr=LR).step()
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        return per_token.detach(), params
    finally:
        T.teardown()


def _packed_deepspeed(rank, world):

    rank_env(rank, world)
    argv = ARGV + ["--context-parallel-size", "4", "--context-parallel-impl", "startrail"]
    model = _model(argv + ["--startrail-team-size", "2"])
    try:
        cfg = ds_config(1, 1, {"enabled": True, "sequence_parallel_size": 4, "team_size": 2})
        engine, _, _, _ = sds.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg
        )
        docs = _packed_docs()
        ids = torch.cat([d[:-1] for d in docs])[None]
        labels = torch.cat([d[1:] for d in docs])[None]
        pos = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
        per_token = engine(ids, pos, None, labels=labels)
        engine.backward(per_token.mean())
        engine.step()
        params = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
        lengths = sorted(get_state().local_lengths)
        del engine
        gc.collect()
        return per_token.detach()[0], lengths, params
    finally:
        T.teardown()


def get_state():
    from megatron.core import parallel_state as ps

    from startrail_megatron.megatron.registry import get_startrail_state

    return get_startrail_state(ps.get_context_parallel_group())


def test_packed_row_through_deepspeed_matches_documents_one_by_one():
    """Per-token losses (padding dropped) and every rank's parameters after one step equal
    Megatron's own attention on each document at CP = 1 (1e-5)."""
    ref, ref_params = run_ranks(1, _packed_reference)[0]
    from startrail_megatron.schedule.packing import pack_lengths

    s_local = pack_lengths(DOC_LENGTHS, 4).s_local
    for per_token, lengths, params in run_ranks(4, _packed_deepspeed):
        assert per_token.shape == ref.shape == (sum(DOC_LENGTHS),)  # padding dropped
        assert (per_token - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert lengths == [s_local]  # StarTrail's per-document layout ran
        assert params.keys() == ref_params.keys()
        for k, r in ref_params.items():
            err = ((params[k] - r).abs().max() / r.abs().max()).item()
            assert err <= 1e-5, f"{k}: {err:.2e}"


def test_launch_reads_configs_as_deepspeed_does(tmp_path, monkeypatch):
    """The DeepSpeed launcher reads the config as DeepSpeed does (hjson) and installs
    Megatron's hooks from its ``"startrail"`` section."""
    import startrail_megatron.megatron as stm
    from startrail_megatron.deepspeed import launch

    calls = []
    monkeypatch.setattr(
        stm,
        "install",
        lambda c, placement, own_rows_first, ulysses_size: calls.append(
            (c, placement, own_rows_first, ulysses_size)
        ),
    )
    path = tmp_path / "ds.json"
    path.write_text(
        "{\n  // DeepSpeed reads its config with hjson: comments are allowed\n"
        '  "train_batch_size": 1,\n'
        '  "startrail": {"enabled": true, "sequence_parallel_size": 8, "team_size": 2,\n'
        '                "own_rows_first": "off", "ulysses_size": 2}\n}\n'
    )
    assert launch._maybe_install_megatron_hooks(["--deepspeed_config", str(path)])
    assert calls == [(2, "team", False, 2)]
