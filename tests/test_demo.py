"""The README's demo, run as a user would (spawned ranks: the spawn sanity check)."""

from __future__ import annotations

import subprocess
import sys


def _demo(*args):
    return subprocess.run(
        [sys.executable, "-m", "startrail_megatron.demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_runs_and_passes():
    res = _demo("--nproc", "4", "--team-size", "2", "--seq-len", "64")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "PASS: worst relative error" in res.stdout
    assert "StarTrail C=2 P2P bytes vs ring: forward 0.333x" in res.stdout


def test_demo_rejects_bad_team_size():
    res = _demo("--nproc", "4", "--team-size", "3")
    assert res.returncode == 2
    assert "team_size=3 does not fit context-parallel size 4" in res.stderr
