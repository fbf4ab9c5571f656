"""The attention variants on one backend (packed documents, a window with soft-capping,
sinks, dropout), one-process StarTrail against float64."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..one_process import one_process_attention
from ..testing import make_inputs, reference_attention, rel_err, unshard
from ..zigzag import zigzag_shard
from .sizes import tolerance

__all__ = ["FEATURES", "check_features"]

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
    from ..kernels import build_kernel as _build
    from ..packing import pack_lengths
    from ..zigzag import shard_packed, unshard_packed

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
