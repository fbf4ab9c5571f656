"""The fault campaign (``scripts/fault_campaign.py``) at CI size: one SIGKILLed rank and one
killed job, each at a seeded random moment of a run saving every iteration (CP = 4, C = 2).
The launcher exits non-zero within the bound and leaves no process behind; the tracker's
checkpoint verifies and resumes to the uninterrupted run's losses, bitwise."""

from __future__ import annotations

from common import load_script

fault_campaign = load_script("fault_campaign")


def test_killed_rank_and_killed_job_resume_exactly():
    records = fault_campaign.campaign(
        ["kill-one", "kill-all"], seeds=1, layout=fault_campaign.LAYOUT.split(), iters=12
    )
    injected = [r for r in records if r["outcome"] != "finished before the fault"]
    assert injected, records  # at least one fault hit a running job
    for r in injected:
        assert r["outcome"] == "pass", r
        assert r["left_behind"] == [] and r.get("loss_max_abs_diff", 0.0) == 0.0, r
        if r["fault"] == "kill-one":
            assert r["launcher_rc"] not in (0, None) and r["exit_s"] <= 30.0, r
