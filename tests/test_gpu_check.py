"""The GPU check script in its CPU mode (what CI can run), and that its checks can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from startrail_megatron import gpu_check
from startrail_megatron.kernels import SdpaKernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_script_cpu_mode(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["passed"] and rep["mode"] == "cpu"
    assert "transformer_engine" in rep["environment"]
    sizes = gpu_check.CPU_SIZES
    n_inputs = len(sizes.dtypes) * len(sizes.check_layouts) * len(sizes.check_heads)
    dense = [c for c in rep["checks"] if "feature" not in c]
    variants = [c for c in rep["checks"] if "feature" in c]
    assert len(dense) == 2 * n_inputs  # "sdpa" and "torch" run on a CPU
    assert {c["backend"] for c in rep["checks"]} == {"sdpa", "torch"}
    for c in dense:
        assert max(c["errors"].values()) <= c["tolerance"]
        assert c["tolerance"] in (2.5e-2, 3.5e-2, 5e-3)
    # the variants per backend and dtype; "sdpa" runs no window and no dropout
    assert len(variants) == 2 * len(sizes.dtypes) * len(gpu_check.FEATURES)
    ran = {(c["backend"], c["feature"]) for c in variants if "skipped" not in c}
    assert ran == {(b, f) for b in ("sdpa", "torch") for f in gpu_check.FEATURES} - {
        ("sdpa", "window+softcap"),
        ("sdpa", "dropout"),
    }
    for c in variants:
        assert c["passed"], c
        if "errors" in c:
            assert max(c["errors"].values()) <= c["tolerance"]
        if c["feature"] == "dropout" and "skipped" not in c:  # out bitwise, grads within tol
            assert c["reproducible"] and set(c["grads_between_runs"]) == {"dq", "dk", "dv"}
    for name in ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "te"):
        assert rep["skipped_backends"][f"{name}/bfloat16"] == "runs on ['cuda'], not 'cpu'"
    (timing,) = rep["timing"]
    assert timing["backend"] == "sdpa" and timing["whole_fwd_s"] > 0
    assert [s["team_size"] for s in timing["startrail"]] == list(sizes.time_cs)
    for s in timing["startrail"]:
        assert len(s["rank_fwd_s"]) == sizes.time_p
        assert 0 < s["efficiency_max"] <= s["efficiency_mean"]
    assert "PASS: 32/32 checks passed" in res.stdout


class _WrongMask(SdpaKernel):
    """A plausible bug: the diagonal blocks computed without their causal mask."""

    def forward(self, q, k, v, *, causal, scale):
        return super().forward(q, k, v, causal=False, scale=scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_catches_a_wrong_kernel(dtype):
    args = (4, 2, True, 4, 2, 8, 1, 32, dtype, torch.device("cpu"))
    assert gpu_check.check_backend("sdpa", *args)["passed"]
    bad = gpu_check.check_backend(_WrongMask(), *args)
    assert not bad["passed"] and bad["errors"]["out"] > 10 * bad["tolerance"]


def test_command_line_errors(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--cpu", "--backends", "sdpa,fa3"])
    assert e.value.code == 2
    assert "--backends: ['fa3'] not known; allowed:" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2
        assert "no CUDA device: run with --cpu" in capsys.readouterr().err
