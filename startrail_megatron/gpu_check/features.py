"""The attention variants on one backend, one-process StarTrail against float64: packed
documents (``packed.py``), a causal window with soft-capping, learned sinks, dropout."""

from __future__ import annotations

from typing import Any

import torch

from ..kernels import build_kernel
from ..testing import make_inputs, reference_attention, rel_err
from .case import GRAD_NAMES, FeatureCase
from .packed import check_packed

__all__ = ["FEATURES", "check_dropout", "check_features", "check_sinks", "check_window_softcap"]


def check_window_softcap(case: FeatureCase) -> dict[str, Any]:
    """A causal window shorter than a rank's tokens, and soft-capped logits where the
    backend runs them; skipped (passed) on a backend that runs no windows."""
    kernel = case.kernel
    if not getattr(kernel, "supports_band", False):
        return case.row(
            "window+softcap", skipped=f"kernel {case.kernel_name!r} runs no windows", passed=True
        )
    cap = 30.0 if getattr(kernel, "supports_softcap", False) else None
    window = (case.s_local // 2 + 3, 0)
    q, k, v, do = make_inputs(2, case.tokens, 1, case.hq, case.hkv, case.head_dim,
                              dtype=case.dtype, device=case.device)  # fmt: skip
    want = reference_attention(q, k, v, do, True, window=window, softcap=cap)
    errs, ok = case.errors(case.run_zigzag(q, k, v, do, window=window, softcap=cap), want)
    return case.row("window+softcap", window=list(window), softcap=cap, errors=errs,
                    tolerance=case.tolerance, passed=ok)  # fmt: skip


def check_sinks(case: FeatureCase) -> dict[str, Any]:
    """Learned sink logits: out, dq, dk, dv and the sinks' gradient."""
    q, k, v, do = make_inputs(3, case.tokens, 1, case.hq, case.hkv, case.head_dim,
                              dtype=case.dtype, device=case.device)  # fmt: skip
    sinks = torch.linspace(-1.0, 2.0, case.hq, device=case.device).requires_grad_()
    want = reference_attention(q, k, v, do, True, sinks=sinks)
    got = case.run_zigzag(q, k, v, do, sinks=sinks)
    errs, ok = case.errors(got + [sinks.grad], list(want), (*GRAD_NAMES, "dsinks"))
    return case.row("sinks", errors=errs, tolerance=case.tolerance, passed=ok)


def check_dropout(case: FeatureCase) -> dict[str, Any]:
    """p = 0.1 twice with the same seed: the output bitwise the same and the gradients within
    the tolerance (fused backwards add dq in atomics, in no fixed order: flash-attn's and
    SDPA's unless deterministic), and the output differs from p = 0 (masks cannot be
    compared with float64 on fused kernels); skipped (passed) on a backend that runs no
    dropout."""
    if not getattr(case.kernel, "supports_dropout", False):
        return case.row(
            "dropout", skipped=f"kernel {case.kernel_name!r} runs no dropout", passed=True
        )
    q, k, v, do = make_inputs(4, case.tokens, 1, case.hq, case.hkv, case.head_dim,
                              dtype=case.dtype, device=case.device)  # fmt: skip
    runs = []
    for pdrop in (0.1, 0.1, 0.0):
        torch.manual_seed(7)
        runs.append(case.run_zigzag(q, k, v, do, dropout_p=pdrop))
    same_out = torch.equal(runs[0][0], runs[1][0])
    grads = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES[1:], runs[0][1:], runs[1][1:])}
    grads_ok = all(e <= case.tolerance for e in grads.values())
    differs = rel_err(runs[0][0], runs[2][0]) > 1e-3
    return case.row("dropout", reproducible=same_out, grads_between_runs=grads,
                    differs_from_p0=differs, passed=same_out and grads_ok and differs)  # fmt: skip


FEATURE_CHECKS = (
    ("packed", check_packed),
    ("window+softcap", check_window_softcap),
    ("sinks", check_sinks),
    ("dropout", check_dropout),
)
"""Each variant's name and its check (a ``FeatureCase`` -> its JSON row)."""

FEATURES = tuple(name for name, _ in FEATURE_CHECKS)
"""What ``check_features`` runs per backend, beside the dense checks of ``check_backend``."""


def check_features(
    kernel_name: str,
    p: int,
    c: int,
    hq: int,
    hkv: int,
    s_local: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[dict[str, Any]]:
    """The attention variants on one backend, one-process StarTrail, causal:

    ``packed``: documents of uneven lengths (flash-attn and TE take the varlen/THD path)
    against float64 per document; ``window+softcap``: a causal window shorter than a rank's
    tokens and soft-capped logits (backends that run them); ``sinks``: learned sink logits,
    their gradient too; ``dropout``: p = 0.1 twice with the same seed is bitwise the same,
    and differs from p = 0 (masks cannot be compared with float64 on fused kernels).
    A variant that raises fails its check (a row with ``error``).
    """
    kernel = build_kernel(kernel_name, dtype, device=device, head_dim=head_dim)
    case = FeatureCase(kernel_name, kernel, p, c, hq, hkv, s_local, head_dim, dtype, device)
    rows: list[dict[str, Any]] = []
    for feature, check in FEATURE_CHECKS:
        try:
            rows.append(check(case))
        except Exception as e:  # a backend that crashes fails its check
            rows.append(case.row(feature, passed=False, error=f"{type(e).__name__}: {e}"))
    return rows
