"""The embedded trainer takes Megatron-LM's GPT command line and real data.

Megatron-LM's example command line (examples/gpt3/train_gpt3_175b_distributed.sh at
core_r0.16.0) scaled down parses and trains on data preprocessed from text; every other
Megatron-LM flag is honoured, ignored with a warning, or refused by name; preprocessing
round-trips; the data path gives CP = 1's losses and validation losses at CP = 4 with
StarTrail (C = 1, 2); the learning rate follows Megatron-LM's formula; the validation loss
is the token-weighted mean over the validation batches (Megatron-LM's); --exit-interval and Ctrl-C stop cleanly and save.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

megatron = pytest.importorskip("megatron.core")  # imported once here, before the ranks fork

from harness import run_ranks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from startrail_megatron.megatron import training as T  # noqa: E402
from startrail_megatron.megatron.preprocess_data import _parser as preprocess_parser  # noqa: E402
from startrail_megatron.megatron.preprocess_data import preprocess  # noqa: E402
from startrail_megatron.megatron.training import flags  # noqa: E402
from startrail_megatron.megatron.training.corpus import (  # noqa: E402
    stdlib_documents,
    train_bpe_tokenizer,
    write_corpus,
)

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """30 standard-library modules, a BPE tokenizer trained on them, the .bin/.idx."""
    root = tmp_path_factory.mktemp("corpus")
    docs = stdlib_documents(limit=30, max_chars=6000)
    jsonl = write_corpus(docs, str(root / "corpus.jsonl"))
    tok = train_bpe_tokenizer(docs, str(root / "tokenizer"), vocab_size=300)
    args = preprocess_parser().parse_args(
        ["--input", jsonl, "--output-prefix", str(root / "data" / "stdlib"),
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok, "--append-eod"]
    )  # fmt: skip
    prefix = preprocess(args, log=lambda *_: None)["text"]
    return {"root": root, "docs": docs, "tokenizer": tok, "prefix": prefix}


def _data(corpus) -> list[str]:
    return [
        "--data-path", corpus["prefix"], "--split", "949,50,1",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", corpus["tokenizer"],
        "--data-cache-path", str(corpus["root"] / "cache"),
    ]  # fmt: skip


def _cp(p: int, c: int) -> list[str]:
    if p == 1:
        return []
    return ["--context-parallel-size", str(p), "--context-parallel-impl", "startrail",
            "--startrail-team-size", str(c)]  # fmt: skip


def _train(rank, world, argv):
    args = T.parse_args(argv)
    return T.train(args)


# ---- the command line ------------------------------------------------------------------
def test_scaled_down_megatron_lm_example_parses_and_trains(corpus, tmp_path):
    """The example's flags (175B -> 2 layers; --fp16, --rampup-batch-size and the GPT-2
    vocab/merge files left out: refused below) on 4 CPU ranks, CP = 4 with StarTrail."""
    ckpt = str(tmp_path / "ckpt")
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "6",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-3",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-4", "--lr-warmup-fraction", ".2",
        "--lr-decay-iters", "5", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", *_data(corpus), "--log-interval", "1",
        "--save-interval", "3", "--eval-interval", "3", "--save", ckpt, "--load", ckpt,
        "--eval-iters", "2", *_cp(4, 2), "--log-json", str(tmp_path / "log.json"),
    ]  # fmt: skip
    log = run_ranks(4, _train, argv)[0]
    assert [e["iteration"] for e in log] == list(range(1, 7))
    assert all(math.isfinite(e["loss"]) for e in log)
    assert [e["iteration"] for e in log if "val_loss" in e] == [3, 6]
    assert "test_loss" not in log[-1]  # 949,50,1 of 30 documents: no test document
    assert log[0]["startrail"]["p2p"] > 0  # StarTrail ran
    # warm-up 0.2 x 5 iterations = 1: lr 0 at iteration 1, then cosine to min-lr at 5
    assert log[0]["lr"] == 0.0 and log[1]["lr"] == pytest.approx(6.0e-3)
    assert log[5]["lr"] == pytest.approx(6.0e-4)
    assert json.loads((tmp_path / "log.json").read_text())[-1]["iteration"] == 6
    assert sorted(os.listdir(ckpt))[:2] == ["iter_0000003", "iter_0000006"]


def test_the_examples_other_flags_are_refused_by_name(capsys):
    cases = {
        "--fp16": "--bf16",
        "--rampup-batch-size 16 16 5859375": "ramp-up",
        "--vocab-file v.json": "HuggingFaceTokenizer",
        "--merge-file m.txt": "HuggingFaceTokenizer",
        "--train-samples 100": "--train-iters",
        "--tokenizer-type GPT2BPETokenizer": "allowed NullTokenizer",
        "--tensorboard-dir tb": "tensorboard",  # not installed here: the JSON log instead
        "--num-experts 8": "launch",
        "--dataloader-type cyclic": "only single",
    }
    for flag, why in cases.items():
        with pytest.raises(SystemExit):
            T.parse_args([*MODEL, *flag.split()])
        err = capsys.readouterr().err
        assert flag.split()[0] in err and why in err, (flag, err)


def test_every_megatron_lm_flag_is_honoured_ignored_or_refused_by_name():
    mlm = flags._megatron_lm_flags()
    assert len(mlm) > 600
    assert set(flags.IGNORED) <= set(mlm) and set(flags.REFUSED) <= set(mlm)
    parser = T.build_parser()
    ours = {s for a in parser._actions if a.help != "==SUPPRESS==" for s in a.option_strings}
    counts = {"honoured": 0, "ignored": 0, "refused": 0}
    for name, kind in mlm.items():
        if name in ours:
            counts["honoured"] += 1
            continue
        values = [] if kind == "flag" else ["1"] * (int(kind) if kind.isdigit() else 1)
        if name == "--dataloader-type":
            values = ["single"]  # the one value that runs here; cyclic is refused below
        args = parser.parse_args([*MODEL, name, *values])  # never "unrecognized arguments"
        if name in flags.IGNORED:
            seen = []
            assert flags.check_megatron_lm_flags(args, seen.append) == [name]
            assert name in seen[0] and flags.IGNORED[name] in seen[0]
            counts["ignored"] += 1
        else:
            with pytest.raises(
                ValueError, match=re.escape(f"Megatron-LM's {name} is refused here")
            ):
                flags.check_megatron_lm_flags(args)
            counts["refused"] += 1
    assert counts["honoured"] > 60 and counts["ignored"] == len(flags.IGNORED), counts
    table = flags.table(parser)
    assert "--lr-decay-style" in table and "--fp16" in table and "--use-flash-attn" in table


# ---- preprocessing ---------------------------------------------------------------------
def test_preprocessing_round_trips(corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from startrail_megatron.megatron.training.tokenizer import HFTokenizer

    tok = HFTokenizer(corpus["tokenizer"])
    ds = IndexedDataset(corpus["prefix"])
    assert len(ds) == len(corpus["docs"])
    for i, text in enumerate(corpus["docs"]):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
        assert tok.detokenize(tok.tokenize(text)) == text  # byte-level: lossless
    # NullTokenizer: text is space-separated ids; no --append-eod
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text('{"text": "3 1 4 1 5"}\n{"body": "x", "text": "9 2 6"}\n')
    argv = ["--input", str(jsonl), "--output-prefix", str(tmp_path / "ids"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]  # fmt: skip
    prefix = preprocess(preprocess_parser().parse_args(argv), log=lambda *_: None)["text"]
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[3, 1, 4, 1, 5], [9, 2, 6]]
    for extra, msg in (
        (["--split-sentences"], "--split-sentences is refused"),
        (["--json-keys", "title"], "no key 'title'"),
    ):
        with pytest.raises(ValueError, match=msg):
            preprocess(preprocess_parser().parse_args(argv + extra), log=lambda *_: None)
    # an id past the vocabulary, or the end-of-document id itself (a hidden boundary)
    for text in ("3 15 4", "3 10 4", "-1 2"):
        jsonl.write_text(f'{{"text": "1 2"}}\n{{"text": "{text}"}}\n')
        with pytest.raises(ValueError, match=r"ids.jsonl:2: NullTokenizer's ids must be in \[0"):
            preprocess(preprocess_parser().parse_args(argv), log=lambda *_: None)


# ---- the data path under StarTrail -----------------------------------------------------
def _data_run(p, c, corpus, extra=()):
    """3 iterations on the corpus (``extra`` last: a later --data-path replaces the first)."""
    argv = [*MODEL, "--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "3",
            "--lr", "3e-3", *_data(corpus), "--eval-interval", "3", "--eval-iters", "2",
            "--log-interval", "100", *_cp(p, c), *extra]  # fmt: skip
    return run_ranks(p, _train, argv)[0]


@pytest.mark.parametrize("c", [1, 2])
def test_data_path_matches_cp1_with_startrail(corpus, c):
    """Training, validation and (once, after training, as Megatron-LM) test losses."""
    split = ["--split", "80,10,10"]  # 3 test documents of 30
    ref = _data_run(1, 1, corpus, split)
    got = _data_run(4, c, corpus, split)
    assert len(got) == len(ref) == 3, (got, ref)
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (got, ref)
    for what in ("val_loss", "test_loss"):
        assert abs(got[-1][what] - ref[-1][what]) <= 1e-5 * ref[-1][what], what
    assert got[-1]["test_loss"] != got[-1]["val_loss"]
    assert got[0]["startrail"]["p2p"] > 0 and "startrail" not in ref[0]


def _eval_case(rank, world, argv, by_hand):
    """The trainer's evaluation (``by_hand`` False) or, by hand at CP = 1 with the same
    initial model, the validation batches' summed token losses over their token count."""
    args = T.parse_args(argv)
    T.initialize(args)
    try:
        model = T.build_model(args)
        _, valid_ds, _ = T.build_datasets(args)
        valid = T.global_batches(args, valid_ds)
        if not by_hand:
            from startrail_megatron.megatron.training.loop import evaluate

            return evaluate(args, model, valid)
        model.eval()
        sums, counts = [], []
        with torch.no_grad():
            for _ in range(args.eval_iters):
                (mb,) = next(valid)
                losses = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
                sums.append(float((losses * mb["loss_mask"]).sum()))
                counts.append(float(mb["loss_mask"].sum()))
        return sum(sums) / sum(counts), sums  # Megatron-LM's: total loss / total tokens
    finally:
        T.teardown()


def test_validation_loss_is_the_token_mean_over_validation_batches(corpus):
    argv = [*MODEL, "--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "4",
            *_data(corpus), "--eval-interval", "2", "--eval-iters", "3", "--eod-mask-loss"]  # fmt: skip
    want, means = run_ranks(1, _eval_case, argv, True)[0]
    assert len(set(means)) == 3  # three different batches
    got = run_ranks(4, _eval_case, argv + _cp(4, 2), False)[0]
    assert abs(got - want) <= 1e-5 * want, (got, want)


# ---- the schedule ----------------------------------------------------------------------
def _megatron_lr(n, *, lr, min_lr, init, warm, decay, style):
    """Megatron-LM's formula (OptimizerParamScheduler.get_lr) at ``n`` samples."""
    if warm > 0 and n <= warm:
        return init + (lr - init) * n / warm
    if style == "constant":
        return lr
    if n > decay:
        return min_lr
    ratio = (n - warm) / (decay - warm)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize(
    "style, warm_flag, warm_iters",
    [("cosine", ["--lr-warmup-iters", "3"], 3), ("linear", ["--lr-warmup-fraction", "0.25"], 2)],
)
def test_learning_rate_follows_megatron_lms_formula(style, warm_flag, warm_iters):
    argv = [*MODEL, "--seq-length", "32", "--micro-batch-size", "2", "--mock-data",
            "--train-iters", "12", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-init",
            "1e-4", "--lr-decay-iters", "8", "--lr-decay-style", style, *warm_flag,
            "--log-interval", "100"]  # fmt: skip
    log = run_ranks(1, _train, argv)[0]
    gbs = 2
    for e in log:
        want = _megatron_lr(
            (e["iteration"] - 1) * gbs, lr=1e-2, min_lr=1e-3, init=1e-4,
            warm=warm_iters * gbs, decay=8 * gbs, style=style,
        )  # fmt: skip
        assert e["lr"] == pytest.approx(want, rel=1e-12), (e["iteration"], e["lr"], want)
    assert log[-1]["lr"] == 1e-3 and log[0]["lr"] == 1e-4


# ---- stopping --------------------------------------------------------------------------
def test_exit_interval_saves_and_stops(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = [*MODEL, "--seq-length", "32", "--micro-batch-size", "2", "--mock-data",
            "--train-iters", "10", "--exit-interval", "3", "--save", ckpt,
            "--log-interval", "100", *_cp(4, 2)]  # fmt: skip
    log = run_ranks(4, _train, argv)[0]
    assert [e["iteration"] for e in log] == [1, 2, 3]
    assert (
        os.listdir(ckpt)
        and open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    )


def test_ctrl_c_saves_and_exits_cleanly(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "startrail_megatron.pretrain_gpt", "--nproc", "2", *MODEL,
           "--seq-length", "32", "--micro-batch-size", "2", "--mock-data", "--train-iters",
           "2000", "--log-interval", "1", "--save", str(ckpt), *_cp(2, 1)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"\s*iteration\s+3/", line):
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
                break
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(lines) + out
    assert proc.returncode == 0, text[-3000:]
    assert "interrupted (Ctrl-C), saving" in text
    it = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= it < 2000 and (ckpt / f"iter_{it:07d}").is_dir()


def test_blend_and_packed_documents_on_real_data_match_cp1(corpus):
    """A weighted blend of two prefixes, documents packed at the tokenizer's EOS
    (--reset-attention-mask, --reset-position-ids, --eod-mask-loss): CP = 4 with StarTrail
    gives CP = 1's losses."""
    p = corpus["prefix"]
    extra = ["--data-path", "0.3", p, "0.7", p, "--split", "90,10,0", "--reset-attention-mask",
             "--reset-position-ids", "--eod-mask-loss"]  # fmt: skip
    ref = _data_run(1, 1, corpus, [*extra, "--context-parallel-impl", "startrail"])  # packed
    got = _data_run(4, 2, corpus, extra)
    assert len(got) == len(ref) == 3, (got, ref)
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (got, ref)
    assert got[0]["startrail"]["p2p"] > 0


def test_a_split_part_without_documents_is_refused(corpus):
    """30 documents split 949,50,1: the test part is empty; a blend asks for it (megatron-
    core would loop forever building it), so it is refused by name."""
    p = corpus["prefix"]
    argv = [*MODEL, "--seq-length", "64", "--train-iters", "2", *_data(corpus),
            "--data-path", "0.5", p, "0.5", p]  # fmt: skip
    with pytest.raises(Exception, match="leaves the test part"):
        run_ranks(1, _train, argv)


def test_a_printed_line_averages_the_iterations_since_the_last():
    """Megatron-LM's ``lm loss`` and time per iteration at --log-interval N are the means
    over the N iterations (it printed the last one's alone)."""
    from startrail_megatron.megatron.training.loop import _interval_mean

    entries = [
        {"iteration": 1, "loss": 4.0, "seconds": 1.0, "tokens_per_s": 100.0},
        {"iteration": 2, "loss": 2.0, "seconds": 3.0, "tokens_per_s": 100.0 / 3},
    ]
    got = _interval_mean(entries)
    assert (got["iteration"], got["loss"], got["seconds"]) == (2, 3.0, 2.0)
    assert abs(got["tokens_per_s"] - 50.0) < 1e-12


def test_init_method_std_and_exit_duration():
    args = T.parse_args([*MODEL, "--mock-data", "--init-method-std", "0.5"])
    assert T.transformer_config(args).init_method_std == 0.5
    argv = [*MODEL, "--seq-length", "32", "--micro-batch-size", "2", "--mock-data",
            "--train-iters", "10", "--exit-duration-in-mins", "0", "--log-interval", "100"]  # fmt: skip
    log = run_ranks(1, _train, argv)[0]
    assert [e["iteration"] for e in log] == [1]  # past the duration after the first one


def test_bf16_trains_on_cpu_ranks_close_to_cp1():
    """--bf16 on CPU ranks: CP = 2 with StarTrail within bf16's tolerance of CP = 1.

    Measured (largest over the 4 iterations, relative to the loss): correct code 4.5e-5 to
    5.1e-5; attention over each CP rank's own tokens only (StarTrail's result replaced by
    local causal attention) 5.7e-4 to 7.7e-4. The bound 2e-4 separates them (2e-2 let the
    local-only attention pass)."""
    argv = [*MODEL, "--seq-length", "32", "--micro-batch-size", "2", "--mock-data", "--bf16",
            "--train-iters", "4", "--log-interval", "100"]  # fmt: skip
    ref = run_ranks(1, _train, argv)[0]
    got = run_ranks(2, _train, argv + _cp(2, 1))[0]
    assert len(got) == len(ref) == 4
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, ref))
    assert worst <= 2e-4, (worst, got, ref)
    assert got[0]["startrail"]["p2p"] > 0


def test_megatron_lm_derivations_and_checks(capsys):
    """Megatron-LM's derived settings and refusals: --group-query-attention alone is MQA,
    --swiglu sizes the MLP at 2/3 x 4h (multiple of 64), weight decay skips biases and norms."""
    args = T.parse_args([*MODEL, "--mock-data", "--group-query-attention"])
    assert args.num_query_groups == 1
    args = T.parse_args(["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads",
                         "4", "--mock-data", "--swiglu"])  # fmt: skip
    assert args.ffn_hidden_size == int(4 * 96 * 2 / 3 / 64) * 64 == 256
    for bad, msg in (
        (["--seq-length", "64", "--max-position-embeddings", "32"], "--max-position-embeddings"),
        (["--log-interval", "0"], "--log-interval"),
        (["--micro-batch-size", "0"], "--micro-batch-size"),
    ):
        with pytest.raises(SystemExit):
            T.parse_args([*MODEL, "--mock-data", *bad])
        assert msg in capsys.readouterr().err
    from startrail_megatron.megatron.training.model import param_groups

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(net, 0.1)
    assert [p.shape for p in decay["params"]] == [(4, 4)] and len(no_decay["params"]) == 3
    assert (decay["wd_mult"], no_decay["wd_mult"], no_decay["weight_decay"]) == (1.0, 0.0, 0.0)


def test_log_peak_memory_counts_the_whole_step():
    """``--log-peak-memory``: each iteration's peak, the largest rank's, counts what the
    step starts with (parameters and their gradients, and from the second iteration
    AdamW's two moments: 4 x 4 bytes per parameter) and the step's own tensors (at 256
    local tokens at least the fp32 logits, 256 x 4,001 x 4 bytes, on top)."""
    base = [*MODEL, "--micro-batch-size", "1", "--mock-data", "--train-iters", "2",
            "--vocab-size", "4000", *_cp(4, 2)]  # fmt: skip
    log = ["--log-peak-memory", "live"]
    short = run_ranks(4, _train, base + log + ["--seq-length", "64"])[0]
    long = run_ranks(4, _train, base + log + ["--seq-length", "1024"])[0]
    params = 4001 * 32 + 2 * (4 * 32 * 32 + 2 * 32 * 128)  # embedding (tied), layers (weights)
    assert short[1]["peak_memory"] >= 4 * 4 * params
    assert long[1]["peak_memory"] >= 4 * 4 * params + 256 * 4001 * 4
    assert long[1]["peak_memory"] > short[1]["peak_memory"]
    assert "peak_memory" not in run_ranks(4, _train, base + ["--seq-length", "64"])[0][1]
