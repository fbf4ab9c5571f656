"""``scripts/megatron_lm_cpu``'s CUDA emulation and runner, without Megatron-LM.

The tool itself (``run.sh``: upstream Megatron-LM's ``pretrain_gpt.py`` on CPU ranks) needs
a Megatron-LM checkout, which CI does not have. What it stands on is checked here: the
runner runs a module like ``python -m`` (its arguments, the current folder importable) after
``cuda_on_cpu.install()``, in a subprocess, since the emulation changes ``torch.cuda`` for
the rest of the process. Without the emulation the probe fails: a CPU build of torch refuses
``device="cuda"``, and a GPU would put the tensors on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "scripts", "megatron_lm_cpu", "runner.py")

PROBE = """
import json, sys, time
import torch

out = {"name": __name__, "argv": sys.argv[1:], "available": torch.cuda.is_available()}
out["devices"] = [torch.cuda.device_count(), torch.cuda.current_device()]
out["zeros"] = torch.zeros(2, device="cuda").device.type
out["moved"] = [
    torch.ones(2).to("cuda").device.type,
    torch.ones(2).to(torch.cuda.current_device()).device.type,
    torch.ones(2).cuda().pin_memory().device.type,
]
out["type"] = torch.ones(2, device="cuda").type()
# CUDA's generator, as Megatron's CudaRNGStatesTracker seeds, saves and restores it
torch.cuda.manual_seed(1234)
drawn = torch.empty(4, device="cuda").normal_()
state = torch.cuda.get_rng_state()
later = torch.randn(4)
torch.cuda.default_generators[torch.cuda.current_device()].set_state(state)
again = torch.randn(4)
torch.manual_seed(1234)
out["rng"] = [torch.equal(drawn, torch.randn(4)), torch.equal(later, again)]
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
time.sleep(0.01)
end.record()
torch.cuda.synchronize()
out["elapsed_ms"] = start.elapsed_time(end)
print("PROBE " + json.dumps(out))
"""


def test_runner_runs_a_module_on_emulated_cuda(tmp_path):
    (tmp_path / "cuda_probe.py").write_text(PROBE)
    env = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    res = subprocess.run(
        [sys.executable, RUNNER, "-m", "cuda_probe", "--flag", "a b"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("PROBE ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(lines[-1][len("PROBE ") :])
    assert out["name"] == "__main__" and out["argv"] == ["--flag", "a b"]
    assert out["available"] is True
    assert out["devices"] == [2, 1]  # one "GPU" per local rank, this rank's current
    assert out["zeros"] == "cpu"
    assert out["moved"] == ["cpu"] * 3
    assert out["type"] == "torch.cuda.FloatTensor"
    assert out["rng"] == [True, True]
    assert out["elapsed_ms"] >= 10.0
