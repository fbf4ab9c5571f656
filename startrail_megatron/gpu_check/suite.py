"""One run: every backend's correctness, then the timings, within a time budget."""

from __future__ import annotations

import sys
import time

import torch

from ..kernels import KernelQuery, build_kernel, unsupported_reason
from ..testing import make_inputs, reference_attention
from .dense import check_backend
from .features import check_features
from .report import Report, environment, print_check, print_timing
from .sizes import CHECK_BACKENDS, TIMED_BACKENDS, Sizes
from .timing import time_backend

__all__ = [
    "backend_unavailable",
    "dense_checks",
    "dtype_name",
    "feature_checks",
    "run",
    "timings",
    "usable_backends",
]


def backend_unavailable(name: str, device: torch.device, dtype: torch.dtype, d: int) -> str | None:
    """Why backend ``name`` cannot run here (``kernels.unsupported_reason``), or None."""
    return unsupported_reason(name, KernelQuery.of(device, dtype, d))


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: the JSON's spelling."""
    return str(dtype).removeprefix("torch.")


def usable_backends(
    rep: Report, sizes: Sizes, backends: tuple[str, ...], dtype: torch.dtype, device: torch.device
) -> list[str]:
    """The ``backends`` that run here in ``dtype`` (they build); the others go to
    ``rep.skipped_backends`` (``name/dtype`` -> why)."""
    names = []
    for name in backends:
        why = backend_unavailable(name, device, dtype, sizes.check_head_dim)
        if why is None:
            try:
                build_kernel(name, dtype, device=device, head_dim=sizes.check_head_dim)
                names.append(name)
                continue
            except Exception as e:  # noqa: BLE001 - a broken install skips its backend only
                why = f"{type(e).__name__}: {e}"
        rep.skipped_backends[f"{name}/{dtype_name(dtype)}"] = why
    return names


def dense_checks(
    rep: Report, sizes: Sizes, names: list[str], dtype: torch.dtype, device: torch.device
) -> None:
    """(a) per layout and heads, every backend in ``names`` against one float64 reference."""
    for p, c, causal in sizes.check_layouts:
        for hq, hkv in sizes.check_heads:
            n = p * sizes.check_s_local
            q, k, v, do = make_inputs(0, n, sizes.check_batch, hq, hkv, sizes.check_head_dim,
                                      dtype=dtype, device=device)  # fmt: skip
            ref = reference_attention(q, k, v, do, causal)
            for name in names:
                row = dict(
                    backend=name, dtype=dtype_name(dtype), P=p, C=c, causal=causal, heads_q=hq,
                    heads_kv=hkv, tokens_per_rank=sizes.check_s_local,
                    head_dim=sizes.check_head_dim,
                )  # fmt: skip
                try:
                    row.update(
                        check_backend(
                            name, p, c, causal, hq, hkv, sizes.check_s_local,
                            sizes.check_batch, sizes.check_head_dim, dtype, device, 0, ref,
                        )
                    )  # fmt: skip
                except Exception as e:  # a backend that crashes fails its check
                    row.update(passed=False, error=f"{type(e).__name__}: {e}")
                rep.checks.append(row)
                print_check(row)
            del ref


def feature_checks(
    rep: Report, sizes: Sizes, names: list[str], dtype: torch.dtype, device: torch.device
) -> None:
    """(a) the attention variants (packed, window + softcap, sinks, dropout) per backend, on
    the first layout and the last heads pair."""
    p, c, _ = sizes.check_layouts[0]
    hq, hkv = sizes.check_heads[-1]
    for name in names:
        try:
            rows = check_features(
                name, p, c, hq, hkv, sizes.check_s_local, sizes.check_head_dim, dtype, device
            )
        except Exception as e:
            rows = [dict(backend=name, dtype=dtype_name(dtype), feature="all", P=p, C=c,
                         heads_q=hq, heads_kv=hkv, passed=False,
                         error=f"{type(e).__name__}: {e}")]  # fmt: skip
        for r in rows:
            rep.checks.append(r)
            print_check(r)


def timings(
    rep: Report, sizes: Sizes, backends: tuple[str, ...], device: torch.device, deadline: float
) -> None:
    """(b) every timed backend that runs here, in the first dtype, until ``deadline``."""
    dtype = sizes.dtypes[0]
    for name in TIMED_BACKENDS:
        if name not in backends or backend_unavailable(name, device, dtype, sizes.time_head_dim):
            continue
        if name == "sdpa" and device.type == "cuda":
            continue  # on CUDA "sdpa" is "sdpa_efficient", timed already
        if f"{name}/{dtype_name(dtype)}" in rep.skipped_backends:
            continue
        if time.monotonic() > deadline:
            rep.timing.append({"backend": name, "skipped": "time budget"})
            continue
        try:
            row = time_backend(name, sizes, dtype, device, deadline)
        except Exception as e:
            row = {"backend": name, "error": f"{type(e).__name__}: {e}"}
        rep.timing.append(row)
        print_timing(row, sizes.time_p)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run(
    sizes: Sizes,
    device: torch.device,
    mode: str,
    budget_s: float,
    backends: tuple[str, ...] = CHECK_BACKENDS,
    timing: bool = True,
) -> Report:
    """(a) every backend's correctness, then (b) the timings, within ``budget_s``."""
    t_start = time.monotonic()
    deadline = t_start + budget_s
    rep = Report(mode, list(sys.argv), environment(device))
    for dtype in sizes.dtypes:
        names = usable_backends(rep, sizes, backends, dtype, device)
        dense_checks(rep, sizes, names, dtype, device)
        feature_checks(rep, sizes, names, dtype, device)
    if timing:
        timings(rep, sizes, backends, device, deadline)
    rep.wall_s = time.monotonic() - t_start
    return rep
