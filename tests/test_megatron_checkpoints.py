"""Checkpoints through the entry point's training.

``python -m startrail_megatron.pretrain_gpt --nproc N``'s per-rank training
(``megatron_common.entry_point_train``: its flags, its loop, its ``--save`` / ``--load`` /
``--log-json``, on N pool ranks instead of N spawned interpreters): a StarTrail run
(CP = 4, C = 2) saves at iteration 2; the checkpoint is loaded at CP = 1, at CP = 2 with
C = 1 and at CP = 8 with C = 2, and a CP = 1 checkpoint is loaded into StarTrail; each
continues with Adam (its state restored from the checkpoint) to iteration 5. Losses and
final parameters (read back from the final distributed checkpoint) equal the
uninterrupted run's.

Tolerances: the same run resumed at the same layout is bitwise the uninterrupted one. A
change of CP layout changes fp32 summation order (~1e-7); Adam turns such noise in
near-zero gradients into updates of up to ``lr``, so the cross-layout runs use
``--adam-eps 1e-4`` (updates linear in such noise) and compare losses to 1e-5 and
parameters to 1e-4 relative to each tensor's largest entry. Measured between the
uninterrupted CP = 1 and StarTrail runs: 2e-6 on megatron-core 0.16; on 0.19, up to
2.7e-5, always in the attention output projection's bias, whose largest entry is only
2.6e-3 (1.2e-7 absolute, as in every other tensor; CP = 2 and CP = 4 with ring attention,
C = 1, give 1.9e-5 and 7.7e-6 there: layout noise, not StarTrail's). After a resume:
< 5e-7. With a fresh Adam state after loading (the state not carried over) the parameters
differ by about 1 (``test_a_fresh_optimizer_state_is_detected``), so the comparison can
fail.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from common import load_script, plant_code
from harness import run_ranks
from megatron_common import entry_point_train

fault_campaign = load_script("fault_campaign")

ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
    "--optimizer", "adam", "--lr", "1e-3", "--adam-eps", "1e-4", "--log-interval", "100",
]  # fmt: skip
ITERS, AT = 5, 2
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


def _layout(cp: int, team: int | None) -> list[str]:
    if cp == 1:
        return []
    flags = ["--context-parallel-size", str(cp)]
    return flags + ["--context-parallel-impl", "startrail", "--startrail-team-size", str(team)]


def _pretrain(tmp, name: str, cp: int, team: int | None, *extra: str) -> dict:
    """One run of the entry point's training on ``cp`` ranks; its per-iteration log and
    final parameters."""
    log, save = tmp / f"{name}.json", tmp / f"{name}_ckpt"
    argv = [*ARGS, *_layout(cp, team)]
    argv += ["--train-iters", str(ITERS), "--log-json", str(log), "--save", str(save), *extra]
    run_ranks(cp, entry_point_train, argv, timeout=600)
    entries = json.loads(log.read_text())
    return {
        "iterations": [e["iteration"] for e in entries],
        "losses": [e["loss"] for e in entries],
        "startrail": [e.get("startrail") for e in entries],
        "params": _params(save, ITERS),
        "save": save,
    }


def _params(save, iteration: int) -> dict:
    """The model parameters of a distributed checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = save.parent / f"{save.name}_{iteration}.pt"
    dcp_to_torch_save(str(save / f"iter_{iteration:07d}"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "_extra" not in k}


def _assert_same_run(got: dict, ref: dict, first: int, loss_tol=LOSS_TOL, param_tol=PARAM_TOL):
    want = list(range(first, ITERS + 1))
    assert got["iterations"] == want, got["iterations"]
    ref_losses = ref["losses"][first - 1 :]
    assert len(got["losses"]) == len(ref_losses)
    for a, b in zip(got["losses"], ref_losses):
        assert abs(a - b) <= loss_tol * abs(b), (got["losses"], ref_losses)
    assert got["params"].keys() == ref["params"].keys() and got["params"]
    for k, r in ref["params"].items():
        err = ((got["params"][k] - r).abs().max() / r.abs().max()).item()
        assert err <= param_tol, f"{k}: {err:.2e}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    every = ("--save-interval", str(AT))
    startrail = _pretrain(tmp, "startrail", 4, 2, *every)  # saves at 2 and 4, and at 5
    cp1 = _pretrain(tmp, "cp1", 1, None, *every)
    return tmp, startrail, cp1


def test_uninterrupted_runs_agree_and_startrail_ran(runs):
    _, startrail, cp1 = runs
    _assert_same_run(startrail, cp1, 1)
    for e in startrail["startrail"]:  # every iteration moved P2P and collective bytes
        assert e is not None and e["p2p"] > 0 and e["collective"] > 0
        assert e["p2p"] < e["ring_p2p"]  # C = 2 at P = 4: fewer P2P bytes than ring


def test_same_layout_resume_is_bitwise(runs):
    tmp, startrail, _ = runs
    load = ("--load", str(startrail["save"]), "--ckpt-step", str(AT))
    again = _pretrain(tmp, "startrail_again", 4, 2, *load)
    _assert_same_run(again, startrail, AT + 1, loss_tol=0, param_tol=0)


def test_a_resume_with_dropout_draws_what_the_uninterrupted_run_draws(tmp_path):
    """Each rank's generator states (torch's and megatron-core's RNG tracker) are in the
    checkpoint and restored at the same layout: with attention and hidden dropout the
    resumed run is bitwise the uninterrupted one. With ``--no-load-rng`` it draws from the
    seed again and differs (as every resume did before the states were kept)."""
    drop = ("--attention-dropout", "0.3", "--hidden-dropout", "0.3")
    whole = _pretrain(tmp_path, "dropout", 4, 2, *drop, "--save-interval", str(AT))
    load = ("--load", str(whole["save"]), "--ckpt-step", str(AT))
    again = _pretrain(tmp_path, "dropout_again", 4, 2, *drop, *load)
    _assert_same_run(again, whole, AT + 1, loss_tol=0, param_tol=0)
    fresh = _pretrain(tmp_path, "dropout_seeded", 4, 2, *drop, *load, "--no-load-rng")
    assert fresh["losses"][0] != whole["losses"][AT]


def test_a_resume_that_could_not_continue_is_refused_and_the_command_line_wins(runs, tmp_path):
    """Each refused by name before anything is read: a checkpoint past --train-iters (the
    loop would not run and the final save would relabel its weights an earlier iteration),
    another --global-batch-size (the data and the schedule would resume at another sample),
    another position embedding. The optimizer's settings are the command line's: a resume
    with another --adam-beta2 trains differently from the same resume without it (the
    checkpoint's would be used otherwise, as megatron-core does)."""
    _, startrail, _ = runs
    save = str(startrail["save"])
    longer = ("--load", save, "--train-iters", str(ITERS + 1))
    cases = {
        r"its checkpoint is of iteration 5, past --train-iters 3": ("--load", save, "--train-iters", "3"),
        r"with --global-batch-size 2 \(this run: 4\)": (*longer, "--global-batch-size", "4"),
        r"position_embedding_type='rope' \(this run: 'learned_absolute'\)": (
            *longer, "--position-embedding-type", "learned_absolute",
        ),
    }  # fmt: skip
    for want, flags in cases.items():
        with pytest.raises(Exception, match=want):
            _pretrain_steps(tmp_path, "refused", 4, 2, *flags)
    load = ("--load", save, "--ckpt-step", str(AT))
    beta = _pretrain(tmp_path, "beta2", 4, 2, *load, "--adam-beta2", "0.9")
    assert beta["losses"][0] == startrail["losses"][AT]  # before any step with it
    assert beta["losses"][1] != startrail["losses"][AT + 1]


@pytest.mark.parametrize("cp, team", [(1, None), (2, 1), (8, 2)])
def test_startrail_checkpoint_continues_at_another_layout(runs, cp, team):
    tmp, startrail, _ = runs
    load = ("--load", str(startrail["save"]), "--ckpt-step", str(AT))
    got = _pretrain(tmp, f"from_startrail_cp{cp}", cp, team, *load)
    _assert_same_run(got, startrail, AT + 1)


def test_cp1_checkpoint_continues_under_startrail(runs):
    tmp, _, cp1 = runs
    load = ("--load", str(cp1["save"]), "--ckpt-step", str(AT))
    got = _pretrain(tmp, "from_cp1", 4, 2, *load)
    _assert_same_run(got, cp1, AT + 1)
    assert all(e is not None and e["p2p"] > 0 for e in got["startrail"])


def test_a_fresh_optimizer_state_is_detected(runs):
    """A checkpoint without its optimizer state is an error naming the file and
    --no-load-optim; with the flag the run starts Adam fresh and diverges (the comparison
    can fail)."""
    tmp, startrail, _ = runs
    ckpt = tmp / "no_optimizer"
    shutil.copytree(startrail["save"], ckpt)
    for f in (ckpt / f"iter_{AT:07d}").glob("optimizer_*.pt"):
        os.remove(f)
    load = ("--load", str(ckpt), "--ckpt-step", str(AT))
    with pytest.raises(Exception, match="optimizer_tp0_of1.pt is missing.*--no-load-optim"):
        _pretrain(tmp, "missing_adam", 4, 2, *load)
    got = _pretrain(tmp, "fresh_adam", 4, 2, *load, "--no-load-optim")
    with pytest.raises(AssertionError):
        _assert_same_run(got, startrail, AT + 1)


def test_a_bad_tracker_is_an_error_naming_it(runs, tmp_path):
    """An empty or garbled tracker (a save killed while writing it) is a ValueError naming
    the file, not int()'s message; a lost one, beside complete checkpoints, one too."""
    _, startrail, _ = runs
    ckpt = tmp_path / "bad_tracker"
    shutil.copytree(startrail["save"], ckpt)
    for text in ("", "12x"):
        (ckpt / "latest_checkpointed_iteration.txt").write_text(text)
        with pytest.raises(Exception, match="latest_checkpointed_iteration.txt holds"):
            _pretrain(tmp_path, "bad", 1, None, "--load", str(ckpt))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("9")  # no such checkpoint
    with pytest.raises(Exception, match="latest_checkpointed_iteration.txt names iteration 9"):
        _pretrain(tmp_path, "nine", 1, None, "--load", str(ckpt))
    (ckpt / "latest_checkpointed_iteration.txt").unlink()  # lost: no silent fresh start
    with pytest.raises(Exception, match="holds complete checkpoints .* but no tracker"):
        _pretrain(tmp_path, "lost", 1, None, "--load", str(ckpt))


@pytest.mark.parametrize("cp, team", [(4, 2), (1, None)])
def test_a_flipped_byte_or_a_missing_manifest_is_an_error_naming_it(runs, tmp_path, cp, team):
    """64 flipped bytes in a model file of the last checkpoint: every rank's load raises
    naming that file (found by whichever rank hashed it), at the saving layout and at
    CP = 1; a folder without the checksum manifest is refused by name. Untouched, the copy
    loads (the checks pass on a good checkpoint)."""
    _, startrail, _ = runs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(startrail["save"], ckpt)
    last = ckpt / f"iter_{ITERS:07d}"
    sums = json.loads((last / "checksums.json").read_text())["files"]
    files = [str(p.relative_to(last)) for p in last.rglob("*") if p.is_file()]
    assert sorted(sums) == sorted(f for f in files if f != "checksums.json")
    assert sorted(f for f in sums if f.startswith("rng/")) == [
        f"rng/rank{r:05d}.pt" for r in range(4)
    ]
    assert any(n.endswith(".distcp") for n in sums) and any(
        n.startswith("optimizer_") for n in sums
    )
    load = ("--load", str(ckpt), "--train-iters", str(ITERS + 1), "--save", str(tmp_path / "s"))
    _pretrain_steps(tmp_path, "good", cp, team, *load)
    victim = sorted(last.glob("*.distcp"))[-1]
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    victim.write_bytes(bytes(data))
    with pytest.raises(Exception, match=f"is corrupted: {victim.name} \\(checksum differs\\)"):
        _pretrain_steps(tmp_path, "flipped", cp, team, *load)
    (last / "checksums.json").unlink()
    with pytest.raises(Exception, match="has no checksums.json"):
        _pretrain_steps(tmp_path, "no_manifest", cp, team, *load)


@pytest.mark.parametrize("victim", [".metadata", "common.pt"])
def test_a_file_that_would_run_code_is_refused_and_runs_nothing(runs, tmp_path, victim):
    """torch.distributed.checkpoint unpickles ``.metadata`` with plain ``pickle.load``: a
    crafted one (its checksum in the manifest too: whoever writes the folder can) is
    refused by name before megatron-core reads it, and its code never runs; ``common.pt``
    likewise."""
    import pickle

    def dump(obj, file):
        with open(file, "wb") as f:
            pickle.dump(obj, f)

    _, startrail, _ = runs
    ckpt = tmp_path / "crafted"
    shutil.copytree(startrail["save"], ckpt)
    last = ckpt / f"iter_{ITERS:07d}"
    marker = tmp_path / "ran"
    plant_code(last / victim, marker, "state", dump)
    load = ("--load", str(ckpt), "--train-iters", str(ITERS + 1))
    want = r"names _?io\.open" if victim == ".metadata" else "holds more than tensors"
    with pytest.raises(Exception, match=f"{victim}.*{want}|{want}"):
        _pretrain_steps(tmp_path, "crafted", 4, 2, *load)
    assert not marker.exists(), "the crafted file ran code"


def test_a_checkpoint_of_another_model_is_refused_by_name(runs, tmp_path):
    """Loading into a model of another width or depth is a ValueError naming each setting
    (saved and asked), before anything is read."""
    _, startrail, _ = runs
    load = ("--load", str(startrail["save"]), "--train-iters", str(ITERS + 1))
    argv = [*ARGS, *_layout(4, 2), *load, "--hidden-size", "128", "--num-layers", "3"]
    with pytest.raises(
        Exception,
        match="holds another model: it was saved with num_layers=2 "
        r"\(this run: 3\), hidden_size=64 \(this run: 128\)",
    ):
        run_ranks(4, entry_point_train, argv, timeout=600)


def _pretrain_steps(tmp, name: str, cp: int, team: int | None, *extra: str) -> None:
    run_ranks(cp, entry_point_train, [*ARGS, *_layout(cp, team), *extra], timeout=600)


def _save_interrupted(rank, world, argv, at):
    """Train with --save every iteration, the save of iteration ``at`` failing on every rank
    after its files are written, while they are hashed (as a crash there would): that save
    is lost, nothing else."""
    from startrail_megatron import checkpoint_files

    plain = checkpoint_files.sha256

    def crash(path):
        if f"iter_{at:07d}" in path:
            raise RuntimeError("crash during the save")
        return plain(path)

    checkpoint_files.sha256 = crash
    try:
        entry_point_train(rank, world, argv)
    except RuntimeError as e:
        return str(e)
    finally:
        checkpoint_files.sha256 = plain
    return None


def test_a_save_that_does_not_finish_leaves_the_last_complete_checkpoint(tmp_path):
    """The save of iteration 3 dies after every file is written, before the manifest: no
    ``iter_0000003`` exists (only its ``.partial`` folder), the tracker still names 2, and a
    resume takes iteration 2's checkpoint (which verifies)."""
    save = tmp_path / "ckpt"
    argv = [*ARGS, *_layout(4, 2), "--train-iters", "4", "--save", str(save)]
    argv += ["--save-interval", "1"]
    errors = run_ranks(4, _save_interrupted, argv, 3, timeout=600)
    assert errors == ["crash during the save"] * 4, errors
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (save / "iter_0000003").exists() and (save / "iter_0000003.partial").is_dir()
    log = tmp_path / "resumed.json"
    resumed = [*ARGS, *_layout(4, 2), "--train-iters", "3", "--load", str(save)]
    run_ranks(4, entry_point_train, [*resumed, "--log-json", str(log)], timeout=600)
    assert [e["iteration"] for e in json.loads(log.read_text())] == [3]


def _write_queue_in_process(rank, world):
    """What ``save_checkpoint`` does before megatron-core's writer asks for its results
    queue: make it with no helper process."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from startrail_megatron.megatron.training.checkpoint import _in_process_write_results_queue

    fa._results_queue = None  # as before a rank's first save
    before = set(mp.active_children())
    _in_process_write_results_queue()
    made = [type(p).__name__ for p in mp.active_children() if p not in before]
    fa._results_queue.put(rank)
    return made, fa._results_queue.get(timeout=10)


def test_the_checkpoint_writers_queue_needs_no_helper_process():
    """megatron-core's Manager would be a process of its own (spawned: a new interpreter that
    imports the entry point again; forked: holding the rank's sockets). The queue works."""
    for rank, (made, got) in enumerate(run_ranks(2, _write_queue_in_process)):
        assert made == [] and got == rank, (made, got)


def test_a_rank_killed_after_a_save_ends_the_job_at_once(tmp_path):
    """``--nproc 4`` (CP = 4, C = 2) saving every iteration: once the first checkpoint is
    written, one rank is SIGKILLed. The launcher must see it at once (exit non-zero well
    within the 10-minute collective timeout) and leave no process behind. With the
    checkpoint writer's forked Manager (which held the rank's sockets and its pipe to the
    launcher) the job hung until the timeout and the Manager outlived it."""
    import signal
    import subprocess
    import sys
    import time

    save, out = tmp_path / "ckpt", tmp_path / "out.txt"
    argv = [*ARGS, *_layout(4, 2), "--train-iters", "100000", "--save", str(save)]
    argv += ["--save-interval", "1", "--optimizer", "sgd"]
    cmd = [sys.executable, "-m", "startrail_megatron.pretrain_gpt", "--nproc", "4", *argv]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        tracker = save / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + 240
        while not tracker.exists():
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        time.sleep(1.0)  # a step or a save under way
        ranks = fault_campaign.children(proc.pid)
        assert len(ranks) >= 4, ranks
        t0 = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
        assert rc != 0 and took < 30, (rc, took)
        time.sleep(1.0)
        left = fault_campaign.group(proc.pid)
        assert left == [], f"processes outlived the job: {left}"
    finally:
        if proc.poll() is None or fault_campaign.group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
