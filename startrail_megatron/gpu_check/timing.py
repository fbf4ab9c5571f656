"""StarTrail's per-rank compute against one call of the same backend on the whole sequence."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..kernels import build_kernel
from ..one_process import RankTimer, one_process_attention
from ..testing import make_inputs
from ..zigzag import zigzag_shard
from .sizes import Sizes

__all__ = ["DeviceClock", "time_backend"]


class DeviceClock:
    """``start()`` -> a token; ``stop(token)`` -> seconds since, synchronizing the device
    once (CUDA events on a CUDA device, else the host's ``perf_counter``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, started) -> float:
        if not self.cuda:
            return time.perf_counter() - started
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return started.elapsed_time(end) / 1e3


def time_backend(
    name: str, sizes: Sizes, dtype: torch.dtype, device: torch.device, deadline: float
) -> dict[str, Any]:
    """Whole-sequence call vs StarTrail per-rank compute for one backend, causal."""
    p, (hq, hkv), d, b = sizes.time_p, sizes.time_heads, sizes.time_head_dim, sizes.time_batch
    n = p * sizes.time_s_local
    kernel = build_kernel(name, dtype, device=device, head_dim=d)
    q, k, v, do = make_inputs(1, n, b, hq, hkv, d, dtype=dtype, device=device)
    scale = d**-0.5
    clock = DeviceClock(device)
    whole_f, whole_b = [], []
    for it in range(sizes.warmup + sizes.reps):
        t0 = clock.start()
        out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
        tf = clock.stop(t0)
        t0 = clock.start()
        kernel.backward(do, q, k, v, out, lse, causal=True, scale=scale)
        tb = clock.stop(t0)
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
