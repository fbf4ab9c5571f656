"""One-device check of every attention backend inside StarTrail, and its per-rank efficiency.

Run by ``scripts/gpu_check.sh`` (``python -m startrail_megatron.gpu_check``):

(a) correctness: for every backend name that can run on this device, the
    one-process StarTrail (``one_process.py``) forward and backward against a
    dense float64 reference of the same (rounded) inputs: max relative error
    of out, dq, dk, dv <= 2.5e-2 (bf16 MHA), 3.5e-2 (bf16 GQA), 5e-3 (fp16).
    ``CHECK_BACKENDS`` includes ``"te"`` (Transformer Engine), checked where TE
    is installed; a backend that cannot run is reported with the reason.
    Then, per backend, the attention variants (``check_features``): packed documents
    (the varlen / THD path on flash-attn and TE), a causal window with soft-capping,
    learned sinks, and dropout's reproducibility.
(b) timing: StarTrail's per-rank compute (kernel calls, merges, reorders; no
    communication) for P ranks and each team size C, against one call of the
    same backend over the whole sequence. Efficiency = t_whole / (P * t_rank),
    with t_rank the slowest rank ("max") or the ranks' mean ("mean"); 1.0 means
    splitting the sequence costs nothing. Peers' reference: zigzag ring
    attention reaches about 0.9 of single-GPU flash-attn on 8 H800.

``--cpu`` runs tiny sizes on the CPU (what CI runs); the default sizes are the
issue's: P = 8, C in {1, 2}, 8192 tokens per rank, head_dim 128, 32 query / 8
KV heads, bf16, causal. Prints a table, writes a JSON, exits 1 if any check
fails. A time budget skips the remaining timings rather than overrun.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from .kernels import BACKENDS, KernelQuery, build_kernel, unsupported_reason
from .one_process import RankTimer, one_process_attention
from .testing import make_inputs, reference_attention, rel_err, shard, unshard
from .zigzag import zigzag_shard

__all__ = ["Sizes", "check_backend", "main", "time_backend", "tolerance"]

CHECK_BACKENDS = (
    "flash_attn",
    "sdpa_flash",
    "sdpa_cudnn",
    "sdpa_efficient",
    "te",
    "sdpa",
    "torch",
)
TIMED_BACKENDS = ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "te", "sdpa")


@dataclass(frozen=True)
class Sizes:
    """The sizes of one mode.

    Attributes:
        check_layouts: (P, C, causal) of the correctness checks.
        check_heads: (heads_q, heads_kv) pairs checked (MHA and GQA).
        check_s_local, check_batch, check_head_dim: tokens per rank, batch, head_dim.
        dtypes: the input dtypes checked (and the first one timed).
        time_p, time_cs: P and the team sizes timed.
        time_s_local, time_heads, time_head_dim, time_batch: the timed shapes.
        reps, warmup: timed repetitions after untimed warm-up ones.
    """

    check_layouts: tuple[tuple[int, int, bool], ...]
    check_heads: tuple[tuple[int, int], ...]
    check_s_local: int
    check_batch: int
    check_head_dim: int
    dtypes: tuple[torch.dtype, ...]
    time_p: int
    time_cs: tuple[int, ...]
    time_s_local: int
    time_heads: tuple[int, int]
    time_head_dim: int
    time_batch: int = 1
    reps: int = 3
    warmup: int = 1


GPU_SIZES = Sizes(
    check_layouts=((8, 2, True), (8, 1, True), (4, 2, False)),
    check_heads=((16, 16), (16, 4)),
    check_s_local=256,
    check_batch=1,
    check_head_dim=128,
    dtypes=(torch.bfloat16, torch.float16),
    time_p=8,
    time_cs=(1, 2),
    time_s_local=8192,
    time_heads=(32, 8),
    time_head_dim=128,
)
CPU_SIZES = Sizes(
    check_layouts=((4, 2, True), (4, 1, False)),
    check_heads=((4, 4), (4, 2)),
    check_s_local=8,
    check_batch=1,
    check_head_dim=32,
    dtypes=(torch.bfloat16, torch.float16),
    time_p=4,
    time_cs=(1, 2),
    time_s_local=32,
    time_heads=(4, 2),
    time_head_dim=32,
    reps=1,
)


def tolerance(dtype: torch.dtype, gqa: bool) -> float:
    """The peers' tolerance on max relative error: bf16 2.5e-2 (MHA) / 3.5e-2 (GQA), fp16 5e-3."""
    if dtype == torch.bfloat16:
        return 3.5e-2 if gqa else 2.5e-2
    if dtype == torch.float16:
        return 5e-3
    return 1e-5 if dtype == torch.float32 else 1e-10


def check_backend(
    kernel: Any,
    p: int,
    c: int,
    causal: bool,
    hq: int,
    hkv: int,
    s_local: int,
    batch: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    ref: tuple[Tensor, ...] | None = None,
) -> dict[str, Any]:
    """One-process StarTrail with ``kernel`` (a name or object) against float64.

    Returns the errors per tensor, the tolerance and ``passed``.
    """
    n = p * s_local
    q, k, v, do = make_inputs(seed, n, batch, hq, hkv, head_dim, dtype=dtype, device=device)
    if ref is None:
        ref = reference_attention(q, k, v, do, causal)
    leaves = [
        [shard(x, r, p, causal).clone().requires_grad_() for r in range(p)] for x in (q, k, v)
    ]
    outs = one_process_attention(*leaves, c, causal=causal, kernel=kernel)
    torch.autograd.backward(outs, [shard(do, r, p, causal) for r in range(p)])
    got = [outs, *([x.grad for x in xs] for xs in leaves)]
    errors = {}
    for name, shards, want in zip(("out", "dq", "dk", "dv"), got, ref):
        errors[name] = rel_err(unshard([s.detach() for s in shards], causal), want)
    tol = tolerance(dtype, hq != hkv)
    ok = all(math.isfinite(e) and e <= tol for e in errors.values())
    return {"errors": errors, "tolerance": tol, "passed": ok}


FEATURES = ("packed", "window+softcap", "sinks", "dropout")
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
    """
    from .kernels import build_kernel as _build
    from .packing import pack_lengths
    from .zigzag import shard_packed, unshard_packed

    kernel = _build(kernel_name, dtype, device=device, head_dim=head_dim)
    rows: list[dict[str, Any]] = []
    tol = tolerance(dtype, hq != hkv)
    n = p * s_local

    def row(feature: str, **kw) -> dict[str, Any]:
        r = dict(backend=kernel_name, dtype=str(dtype).removeprefix("torch."), feature=feature,
                 P=p, C=c, heads_q=hq, heads_kv=hkv, tokens_per_rank=s_local, **kw)  # fmt: skip
        rows.append(r)
        return r

    def errs(got, want, names=("out", "dq", "dk", "dv")):
        e = {k: rel_err(g, w) for k, g, w in zip(names, got, want)}
        return e, all(math.isfinite(x) and x <= tol for x in e.values())

    def run_dense(q, k, v, do, **kw):
        leaves = [[zigzag_shard(x, r, p).clone().requires_grad_() for r in range(p)]
                  for x in (q, k, v)]  # fmt: skip
        outs = one_process_attention(*leaves, c, kernel=kernel, **kw)
        torch.autograd.backward(outs, [zigzag_shard(do, r, p) for r in range(p)])
        got = [outs, *([x.grad for x in xs] for xs in leaves)]
        return [unshard([t.detach() for t in g], True) for g in got]

    def attempt(feature: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # a backend that crashes fails its check
            row(feature, passed=False, error=f"{type(e).__name__}: {e}")

    def packed() -> None:
        lengths = [n // 2 + 3, 1, n // 4 - 7, 0, n // 8 + 5]
        lay = pack_lengths(lengths, p)
        q, k, v, do = make_inputs(1, sum(lengths), 1, hq, hkv, head_dim, dtype=dtype,
                                  device=device)  # fmt: skip
        docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        want = reference_attention(q, k, v, do, True, doc_ids=docs)
        leaves = [[shard_packed(x, lay, r).clone().requires_grad_() for r in range(p)]
                  for x in (q, k, v)]  # fmt: skip
        outs = one_process_attention(*leaves, c, kernel=kernel, cu_seqlens=lay.cu_seqlens,
                                     cu_seqlens_padded=lay.cu_seqlens_padded)  # fmt: skip
        torch.autograd.backward(outs, [shard_packed(do, lay, r) for r in range(p)])
        got = [outs, *([x.grad for x in xs] for xs in leaves)]
        e, ok = errs([unshard_packed([t.detach() for t in g], lay) for g in got], want)
        row("packed", errors=e, tolerance=tol, passed=ok)

    def window_softcap() -> None:
        if not getattr(kernel, "supports_band", False):
            row("window+softcap", skipped=f"kernel {kernel_name!r} runs no windows", passed=True)
            return
        cap = 30.0 if getattr(kernel, "supports_softcap", False) else None
        window = (s_local // 2 + 3, 0)
        q, k, v, do = make_inputs(2, n, 1, hq, hkv, head_dim, dtype=dtype, device=device)
        want = reference_attention(q, k, v, do, True, window=window, softcap=cap)
        e, ok = errs(run_dense(q, k, v, do, window=window, softcap=cap), want)
        row("window+softcap", window=list(window), softcap=cap, errors=e, tolerance=tol,
            passed=ok)  # fmt: skip

    def sinks() -> None:
        q, k, v, do = make_inputs(3, n, 1, hq, hkv, head_dim, dtype=dtype, device=device)
        sk = torch.linspace(-1.0, 2.0, hq, device=device).requires_grad_()
        want = reference_attention(q, k, v, do, True, sinks=sk)
        got = run_dense(q, k, v, do, sinks=sk)
        e, ok = errs(got + [sk.grad], list(want), ("out", "dq", "dk", "dv", "dsinks"))
        row("sinks", errors=e, tolerance=tol, passed=ok)

    def dropout() -> None:
        if not getattr(kernel, "supports_dropout", False):
            row("dropout", skipped=f"kernel {kernel_name!r} runs no dropout", passed=True)
            return
        q, k, v, do = make_inputs(4, n, 1, hq, hkv, head_dim, dtype=dtype, device=device)
        runs = []
        for pdrop in (0.1, 0.1, 0.0):
            torch.manual_seed(7)
            runs.append(run_dense(q, k, v, do, dropout_p=pdrop))
        same = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
        differs = rel_err(runs[0][0], runs[2][0]) > 1e-3
        row("dropout", reproducible=same, differs_from_p0=differs, passed=same and differs)

    for name, fn in (("packed", packed), ("window+softcap", window_softcap),
                     ("sinks", sinks), ("dropout", dropout)):  # fmt: skip
        attempt(name, fn)
    return rows


def _clock(device: torch.device):
    """start() -> token; stop(token) -> seconds, synchronizing the device once."""
    if device.type == "cuda":

        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return ev.elapsed_time(end) / 1e3

        return start, stop
    return time.perf_counter, lambda t0: time.perf_counter() - t0


def time_backend(
    name: str, sizes: Sizes, dtype: torch.dtype, device: torch.device, deadline: float
) -> dict[str, Any]:
    """Whole-sequence call vs StarTrail per-rank compute for one backend, causal."""
    p, (hq, hkv), d, b = sizes.time_p, sizes.time_heads, sizes.time_head_dim, sizes.time_batch
    n = p * sizes.time_s_local
    kernel = build_kernel(name, dtype, device=device, head_dim=d)
    q, k, v, do = make_inputs(1, n, b, hq, hkv, d, dtype=dtype, device=device)
    scale = d**-0.5
    start, stop = _clock(device)
    whole_f, whole_b = [], []
    for it in range(sizes.warmup + sizes.reps):
        t0 = start()
        out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
        tf = stop(t0)
        t0 = start()
        kernel.backward(do, q, k, v, out, lse, causal=True, scale=scale)
        tb = stop(t0)
        del out, lse
        if it >= sizes.warmup:
            whole_f.append(tf)
            whole_b.append(tb)
    res: dict[str, Any] = {
        "backend": name,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": n,
        "tokens_per_rank": sizes.time_s_local,
        "heads_q": hq,
        "heads_kv": hkv,
        "head_dim": d,
        "batch": b,
        "whole_fwd_s": min(whole_f),
        "whole_bwd_s": min(whole_b),
        "startrail": [],
    }
    shards = [[zigzag_shard(x, r, p) for r in range(p)] for x in (q, k, v, do)]
    for c in sizes.time_cs:
        if time.monotonic() > deadline:
            res["startrail"].append({"team_size": c, "skipped": "time budget"})
            continue
        timer = RankTimer(p, device)
        fwd = [0.0] * p
        bwd = [0.0] * p
        for it in range(sizes.warmup + sizes.reps):
            leaves = [[x.detach().requires_grad_() for x in xs] for xs in shards[:3]]
            timer.reset()
            outs = one_process_attention(*leaves, c, causal=True, kernel=kernel, timer=timer)
            f = timer.totals()
            timer.reset()
            torch.autograd.backward(outs, shards[3])
            bw = timer.totals()
            del outs, leaves
            if it >= sizes.warmup:
                fwd = [a + x / sizes.reps for a, x in zip(fwd, f)]
                bwd = [a + x / sizes.reps for a, x in zip(bwd, bw)]
        tot = [a + x for a, x in zip(fwd, bwd)]
        whole = res["whole_fwd_s"] + res["whole_bwd_s"]
        res["startrail"].append(
            {
                "team_size": c,
                "rank_fwd_s": fwd,
                "rank_bwd_s": bwd,
                "efficiency_fwd_max": res["whole_fwd_s"] / (p * max(fwd)),
                "efficiency_bwd_max": res["whole_bwd_s"] / (p * max(bwd)),
                "efficiency_max": whole / (p * max(tot)),
                "efficiency_mean": whole / sum(tot),
            }
        )
    return res


def _environment(device: torch.device) -> dict[str, Any]:
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


def _available(name: str, device: torch.device, dtype: torch.dtype, d: int) -> str | None:
    return unsupported_reason(name, KernelQuery.of(device, dtype, d))


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
    rep = Report(mode, list(sys.argv), _environment(device))
    for dtype in sizes.dtypes:
        names = []
        for name in backends:
            why = _available(name, device, dtype, sizes.check_head_dim)
            if why is None:
                try:
                    build_kernel(name, dtype, device=device, head_dim=sizes.check_head_dim)
                    names.append(name)
                    continue
                except (ImportError, OSError, NotImplementedError) as e:
                    why = f"{type(e).__name__}: {e}"
            rep.skipped_backends[f"{name}/{str(dtype).removeprefix('torch.')}"] = why
        for p, c, causal in sizes.check_layouts:
            for hq, hkv in sizes.check_heads:
                n = p * sizes.check_s_local
                q, k, v, do = make_inputs(
                    0,
                    n,
                    sizes.check_batch,
                    hq,
                    hkv,
                    sizes.check_head_dim,
                    dtype=dtype,
                    device=device,
                )
                ref = reference_attention(q, k, v, do, causal)
                for name in names:
                    row = dict(
                        backend=name,
                        dtype=str(dtype).removeprefix("torch."),
                        P=p,
                        C=c,
                        causal=causal,
                        heads_q=hq,
                        heads_kv=hkv,
                        tokens_per_rank=sizes.check_s_local,
                        head_dim=sizes.check_head_dim,
                    )
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
                    _print_check(row)
                del ref
        # the attention variants (packed, window + softcap, sinks, dropout) per backend
        p, c, _ = sizes.check_layouts[0]
        hq, hkv = sizes.check_heads[-1]
        for name in names:
            try:
                rows = check_features(
                    name, p, c, hq, hkv, sizes.check_s_local, sizes.check_head_dim, dtype, device
                )
            except Exception as e:
                rows = [dict(backend=name, dtype=str(dtype).removeprefix("torch."),
                             feature="all", P=p, C=c, heads_q=hq, heads_kv=hkv, passed=False,
                             error=f"{type(e).__name__}: {e}")]  # fmt: skip
            for r in rows:
                rep.checks.append(r)
                _print_check(r)
    if timing:
        dtype = sizes.dtypes[0]
        for name in TIMED_BACKENDS:
            if name not in backends or _available(name, device, dtype, sizes.time_head_dim):
                continue
            if name == "sdpa" and device.type == "cuda":
                continue  # on CUDA "sdpa" is "sdpa_efficient", timed already
            if f"{name}/{str(dtype).removeprefix('torch.')}" in rep.skipped_backends:
                continue
            if time.monotonic() > deadline:
                rep.timing.append({"backend": name, "skipped": "time budget"})
                continue
            try:
                row = time_backend(name, sizes, dtype, device, deadline)
            except Exception as e:
                row = {"backend": name, "error": f"{type(e).__name__}: {e}"}
            rep.timing.append(row)
            _print_timing(row, sizes.time_p)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rep.wall_s = time.monotonic() - t_start
    return rep


def _print_check(row: dict[str, Any]) -> None:
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


def _print_timing(row: dict[str, Any], p: int) -> None:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m startrail_megatron.gpu_check", description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (CI)")
    ap.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="skip timings that would start after this"
    )
    ap.add_argument("--no-timing", action="store_true", help="only the correctness checks")
    ap.add_argument(
        "--backends",
        default=",".join(CHECK_BACKENDS),
        help=f"comma-separated subset of {list(CHECK_BACKENDS)}",
    )
    args = ap.parse_args(argv)
    backends = tuple(b for b in args.backends.split(",") if b)
    bad = [b for b in backends if b not in CHECK_BACKENDS or b not in BACKENDS]
    if bad:
        ap.error(f"--backends: {bad} not known; allowed: {list(CHECK_BACKENDS)}")
    if args.cpu:
        device, sizes, mode = torch.device("cpu"), CPU_SIZES, "cpu"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu for the CPU mode", file=sys.stderr)
            return 2
        device, sizes, mode = torch.device("cuda", torch.cuda.current_device()), GPU_SIZES, "gpu"
    print(f"gpu_check mode={mode} device={device} torch={torch.__version__}", flush=True)
    rep = run(sizes, device, mode, args.budget_s, backends, timing=not args.no_timing)
    for key, why in rep.skipped_backends.items():
        print(f"SKIP {key}: {why}", flush=True)
    out = asdict(rep)
    out["passed"] = rep.passed
    out["sizes"] = {k: (str(v) if k == "dtypes" else v) for k, v in asdict(sizes).items()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    n_fail = sum(not c["passed"] for c in rep.checks)
    print(
        f"{'PASS' if rep.passed else 'FAIL'}: {len(rep.checks) - n_fail}/{len(rep.checks)} checks "
        f"passed, {len(rep.timing)} timings, {rep.wall_s:.1f} s; wrote {args.out}",
        flush=True,
    )
    return 0 if rep.passed else 1


if __name__ == "__main__":
    sys.exit(main())
