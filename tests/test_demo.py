"""The README's demo, run as a user would (spawned ranks: the spawn sanity check)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from startrail_megatron.accounting import LocalShape, startrail_comm_bytes
from startrail_megatron.schedule.layout import StarTrailLayout


def _demo(*args):
    return subprocess.run(
        [sys.executable, "-m", "startrail_megatron.demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_runs_and_passes(tmp_path):
    """The figures the demo prints, from its JSON: errors against float64 and every rank's
    bytes summed, against the accounting for the demo's shapes (seq 64, batch 2, 8 q / 2 KV
    heads of 64, fp32)."""
    out = tmp_path / "demo.json"
    res = _demo("--nproc", "4", "--team-size", "2", "--seq-len", "64", "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "PASS: worst relative error" in res.stdout
    rows = {r["team_size"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == [1, 2]
    shape = LocalShape(16, 2, 8, 2, 64, elem_bytes=4, acc_bytes=4)
    for c, row in rows.items():
        assert max(row["errors"].values()) < 1e-5, row
        lay = StarTrailLayout(4, c)
        want = [startrail_comm_bytes(lay, r, shape) for r in range(4)]
        assert row["p2p_fwd"] == sum(w["fwd_p2p"] for w in want)
        assert row["p2p_bwd"] == sum(w["bwd_p2p"] for w in want)
        assert row["collective"] == sum(w["fwd_collective"] + w["bwd_collective"] for w in want)
    # P = 4, C = 2 (one sub-ring step): the placement's pieces only, 6 local K,V over the
    # 4 ranks against ring's 12 (and no K,V collective).
    assert rows[2]["p2p_fwd"] / rows[1]["p2p_fwd"] == pytest.approx(1 / 2)
    assert "StarTrail C=2 P2P bytes vs ring: forward 0.500x" in res.stdout


def test_demo_rejects_bad_team_size():
    res = _demo("--nproc", "4", "--team-size", "3")
    assert res.returncode == 2
    assert "team_size=3 does not fit context-parallel size 4" in res.stderr
