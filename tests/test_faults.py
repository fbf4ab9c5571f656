"""The fault campaign (``scripts/fault_campaign.py``) at CI size, one seed: on the GPT entry
point (CP = 4, C = 2) a disk that fills during a save and a damaged checkpoint; on the
DeepSpeed path (torchrun, P = 4, C = 2, ZeRO 2) a damaged checkpoint. Each ends non-zero
within the bound, named, leaves no process behind, and the tracker's checkpoint resumes to
the uninterrupted run's losses bitwise. Elsewhere in CI: a killed rank
(``test_a_rank_killed_after_a_save_ends_the_job_at_once``), a DeepSpeed save that dies
(``test_deepspeed_checkpoints.py``), stopped ranks (``test_spawn.py``). The killed ranks
on torchrun, the stalled rank and the cut link (60 s collective timeout): the campaign's
full runs only (``docs/reliability.md``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from common import load_script
from ds_common import rank_env
from harness import run_ranks

fault_campaign = load_script("fault_campaign")

ROOT = os.geteuid() == 0  # the full disk is a tmpfs
ITERS = 5


def _check(records: list[dict]) -> None:
    injected = [r for r in records if r["outcome"] != "finished before the fault"]
    assert injected, records  # at least one fault hit a running job
    for r in injected:
        assert r["outcome"] == "pass", r
        assert r.get("left_behind", []) == [] and r.get("loss_max_abs_diff", 0.0) == 0.0, r
        if r["fault"] in ("kill-one", "full-disk", "corrupt"):
            assert r["launcher_rc"] not in (0, None), r
        if r["fault"] in ("kill-one", "full-disk"):
            assert r["exit_s"] <= 30.0, r
        if r["fault"] in ("kill-one", "full-disk", "corrupt"):
            assert r["named"], r


@pytest.fixture(scope="module")
def megatron_ref(tmp_path_factory):
    """The Megatron job's uninterrupted run (5 iterations, saving each), shared."""
    job = fault_campaign.Job("megatron", fault_campaign.LAYOUT.split())
    return job, fault_campaign.reference(job, ITERS, str(tmp_path_factory.mktemp("ref")))


def test_megatron_faults_end_named_and_resume_exactly(megatron_ref):
    job, ref = megatron_ref
    faults = ["full-disk", "corrupt"] if ROOT else ["corrupt"]
    _check(fault_campaign.campaign(faults, seeds=1, job=job, iters=ITERS, ref=ref))


def _ds_run(rank: int, world: int, argv: list[str]) -> None:
    """The uninterrupted DeepSpeed run's rank, in the suite's warm ranks: the launcher's
    own arguments to ``startrail_megatron.deepspeed.launch``, as torchrun would run it."""
    import gc

    from startrail_megatron.deepspeed import launch

    rank_env(rank, world)
    launch.main(argv)
    gc.collect()


def test_deepspeed_faults_end_named_and_resume_exactly(tmp_path):
    """The damaged checkpoint's resume runs under torchrun; the uninterrupted run that saved
    it (the same script, config and arguments) runs in the suite's ranks, which have
    DeepSpeed imported already: one torchrun start of 4 ranks fewer."""
    job = fault_campaign.Job("deepspeed", [fault_campaign.DS_CONFIG])
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "log.json")
    cmd = job.cmd(ITERS, save, log)
    argv = cmd[cmd.index("startrail_megatron.deepspeed.launch") + 1 :]
    run_ranks(job.nproc(job.layout), _ds_run, argv)
    losses = job.losses(log)
    assert sorted(losses) == list(range(1, ITERS + 1)), losses
    ref = fault_campaign.Reference(losses, 0.0, 0, save)  # delay and size: timed faults only
    # torchrun's ranks load DeepSpeed's CPU shared-memory op, which the suite's ranks skip
    # (tests/harness.py); a fresh clone's venv rebuilds it (35 - 45 s): built here first, in
    # the job's environment, outside the trial's exit bound, as the torchrun reference did
    build = "from deepspeed.accelerator import get_accelerator as g; " + (
        "b = g().create_op_builder('ShareMemCommBuilder'); b is None or b.load()"
    )
    env = fault_campaign._env()
    subprocess.run([sys.executable, "-c", build], env=env, check=True, capture_output=True)
    _check(fault_campaign.campaign(["corrupt"], seeds=1, job=job, iters=ITERS, ref=ref))


def test_the_checks_see_an_undetected_damage(megatron_ref, tmp_path, monkeypatch):
    """The corrupt trial's oracle can fail: a damage the resume does not refuse (here none
    at all: the resume runs, exit 0) is a FAIL."""
    job, ref = megatron_ref
    monkeypatch.setattr(fault_campaign, "_damage", lambda *a: ("none", "never printed"))
    rec = fault_campaign.trial("corrupt", 0, job, ITERS, ref, str(tmp_path), 30.0)
    assert rec["outcome"] == "FAIL" and rec["launcher_rc"] == 0, rec
