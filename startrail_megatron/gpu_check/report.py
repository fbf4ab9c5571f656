"""What one run found: the environment, the ``Report`` written as the JSON, and the lines
printed per check and per timing."""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Report", "environment", "print_check", "print_timing"]


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    try:
        import flash_attn

        env["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception as e:  # not installed, or a broken build
        env["flash_attn"] = f"unavailable ({type(e).__name__})"
    try:  # the distribution's version: importing TE loads its CUDA libraries
        env["transformer_engine"] = importlib.metadata.version("transformer_engine")
    except Exception as e:
        env["transformer_engine"] = f"unavailable ({type(e).__name__})"
    return env


@dataclass
class Report:
    """Everything one run found; written as the JSON (plus ``passed`` and ``sizes``)."""

    mode: str
    command: list[str]
    environment: dict[str, Any]
    checks: list[dict[str, Any]] = field(default_factory=list)
    skipped_backends: dict[str, str] = field(default_factory=dict)
    timing: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks) and bool(self.checks)


def print_check(row: dict[str, Any]) -> None:
    errs = row.get("errors")
    what = " ".join(f"{k}={v:.2e}" for k, v in errs.items()) if errs else row.get("error", "?")
    if "skipped" in row:
        what = f"skipped: {row['skipped']}"
    elif "reproducible" in row:
        what = f"reproducible={row['reproducible']} differs_from_p0={row['differs_from_p0']}"
    kind = row.get("feature") or ("causal" if row.get("causal") else "full")
    print(
        f"{'PASS' if row['passed'] else 'FAIL'} {row['backend']:>14} {row['dtype']:>8} "
        f"P={row['P']} C={row['C']} {kind:>14} "
        f"{row['heads_q']}q/{row['heads_kv']}kv  {what}  (tol {row.get('tolerance', '-')})",
        flush=True,
    )


def print_timing(row: dict[str, Any], p: int) -> None:
    if "error" in row:
        print(f"TIMING {row['backend']}: {row['error']}", flush=True)
        return
    print(
        f"TIMING {row['backend']} {row['dtype']} {row['tokens']} tokens "
        f"({row['tokens_per_rank']}/rank), {row['heads_q']}q/{row['heads_kv']}kv d={row['head_dim']}:"
        f" whole-sequence fwd {row['whole_fwd_s'] * 1e3:.2f} ms, bwd {row['whole_bwd_s'] * 1e3:.2f} ms",
        flush=True,
    )
    for st in row["startrail"]:
        if "skipped" in st:
            print(f"  C={st['team_size']}: skipped ({st['skipped']})", flush=True)
            continue
        print(
            f"  P={p} C={st['team_size']}: slowest rank fwd {max(st['rank_fwd_s']) * 1e3:.2f} ms, "
            f"bwd {max(st['rank_bwd_s']) * 1e3:.2f} ms; efficiency (whole / (P x slowest rank)) "
            f"fwd {st['efficiency_fwd_max']:.3f} bwd {st['efficiency_bwd_max']:.3f} "
            f"fwd+bwd {st['efficiency_max']:.3f} (mean-rank {st['efficiency_mean']:.3f})",
            flush=True,
        )
