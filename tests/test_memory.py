"""Memory of one StarTrail call: what the forward keeps, and the peak, per layout.

* Kept from the forward for the backward (the autograd node's saved tensors): exactly
  (C + 3) A (team q, this rank's K,V, and out; ring: q, K,V, out: 4 A) plus the team
  rows' log-sum-exp, below the paper's (3C + 1) A for C > 1.
* Peak of one forward + backward on each rank, by a dispatch-level tracker of live
  tensor storages: at most the caller's tensors + ``planner.memory.startrail_buffers``
  (the list docs/performance.md prints) + the kernel's own workspace, measured alone
  on the largest possible call (a whole team block); with full attention, where every
  step is that one call, not far below it, so the list is what the code holds.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from common import groups_for, make_inputs, shard
from harness import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import startrail_megatron as st
from startrail_megatron.kernels import resolve_kernel
from startrail_megatron.planner.memory import startrail_buffers
from startrail_megatron.planner.shape import AttnShape

B, HQ, HKV, D = 1, 4, 2, 64


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created inside (and of those ``hold`` adds)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def hold(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in self.live or not s.nbytes():
            return
        self.live[key] = s.nbytes()
        self.now += s.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(s, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.hold(t)
        return out


def _shape(p, s_local) -> AttnShape:
    return AttnShape(p, s_local, B, HQ, HKV, D, elem_bytes=4, acc_bytes=4, causal=True)


def _memory_rank(rank, world, c, s_local, causal, orf=None, tile=None):
    p = world
    comm = st.comm.CommOptions(own_rows_first=orf)
    groups = groups_for(c)
    q, k, v, do = make_inputs(1, s_local * p, B, HQ, HKV, D)
    local = [shard(x, rank, p, causal).float().contiguous() for x in (q, k, v, do)]
    leaves = [x.clone().requires_grad_() for x in local[:3]]
    out = st.startrail_attention(
        *leaves, groups, causal=causal, kernel="sdpa", comm_options=comm, tile=tile
    )  # agree once
    saved = sum(t.untyped_storage().nbytes() for t in out.grad_fn.saved_tensors if t is not None)
    saved_q_alias = out.grad_fn.saved_tensors[1].data_ptr() == leaves[0].data_ptr()
    out.backward(local[3])
    del out
    for x in leaves:
        x.grad = None
    # The kernel's own workspace: its largest call (a whole team block, or a tile) alone.
    n = c * s_local if tile is None else min(tile, c * s_local)
    kern, scale = resolve_kernel(leaves[0], "sdpa", None)
    blk = [torch.randn(n, B, h, D) for h in (HQ, HKV, HKV, HQ, HQ)]
    lse = torch.randn(B, HQ, n)
    with LiveBytes() as one:
        for x in [*blk, lse]:  # held before: views of them are not new memory
            one.hold(x)
        kern.backward(blk[3], blk[0], blk[1], blk[2], blk[4], lse, causal=causal, scale=scale)
    kernel_ws = one.peak - sum(x.untyped_storage().nbytes() for x in [*blk, lse])
    with LiveBytes() as mem:
        for x in [*leaves, local[3]]:
            mem.hold(x)
        out = st.startrail_attention(
            *leaves, groups, causal=causal, kernel="sdpa", comm_options=comm, tile=tile
        )
        out.backward(local[3])
        del out
    return saved, saved_q_alias, mem.peak, kernel_ws


@pytest.mark.parametrize(
    "p,c,orf",
    [
        (8, 1, None),
        (4, 2, None),
        (8, 2, None),
        (4, 2, True),
        (8, 2, True),
        pytest.param(16, 4, None, marks=pytest.mark.slow),
    ],
    ids=["P8-C1", "P4-C2", "P8-C2", "P4-C2-own-rows-first", "P8-C2-own-rows-first", "P16-C4"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_kept_and_peak_memory_per_layout(p, c, orf, causal):
    """``orf``: ``CommOptions(own_rows_first=)`` (None: the default, off on one host)."""
    s_local = 64
    shape = _shape(p, s_local)
    a_q = s_local * B * HQ * D * 4  # A: one local q (or out) tensor, bytes
    a_kv = s_local * B * HKV * D * 4
    lse = c * s_local * B * HQ * 4
    buffers = startrail_buffers(c, shape)
    caller = a_q + 2 * a_kv + a_q + a_q  # q, k, v leaves, dout, out
    res = run_ranks(p, _memory_rank, c, s_local, causal, orf)
    for r, (saved, alias, peak, kernel_ws) in enumerate(res):
        need = buffers
        # (C + 3) A with GQA's K,V at their own size: team q, own K,V, out; ring's q is q.
        # The paper's (3C + 1) A keeps the team's K,V; the direct placement needs only
        # this rank's (layout.py's Note).
        assert saved == c * a_q + 2 * a_kv + a_q + lse, (r, saved)
        assert alias == (c == 1), r
        # the kernel's workspace replaces the call's gradients; the call's output stand-in
        # (the whole team block's rows: rank.kernel_calls.delta_stand_in) is made before it,
        # with two of its per-row statistics ([rows, heads] fp32) alive while it is made
        stand_in = c * a_q + 2 * c * s_local * B * HQ * 4
        bound = caller + sum(need.values()) - need["kernel call"] + stand_in + kernel_ws
        assert peak <= bound, (r, peak, bound, buffers)
        if not causal and not orf:  # one call per step on the whole team block: the bound
            assert peak >= 0.9 * bound, (r, peak, bound)  # is what runs (own rows first
            # cuts the first step's calls, and each call's stand-in is its rows')


def test_the_tile_bounds_the_backward_peak():
    """``startrail_attention(tile=)``: a call's transient memory (its output stand-in, dq,
    dK, dV and the kernel's workspace) is bounded by the tile, so the peak stays under the
    list with the tile's call (``startrail_buffers(tile=)``), which the whole calls'
    peak exceeds (full attention: every step one whole team block)."""
    p, c, s_local, tile = 4, 2, 128, 16
    shape = _shape(p, s_local)
    a_q, a_kv = s_local * B * HQ * D * 4, s_local * B * HKV * D * 4
    caller = a_q + 2 * a_kv + a_q + a_q
    tiled = run_ranks(p, _memory_rank, c, s_local, False, None, tile)
    whole = run_ranks(p, _memory_rank, c, s_local, False, None, None)
    need = startrail_buffers(c, shape, tile)
    for r, ((_, _, peak, ws), (_, _, whole_peak, _)) in enumerate(zip(tiled, whole)):
        bound = caller + sum(need.values()) + ws
        assert peak <= bound, (r, peak, bound, need)
        assert whole_peak > bound, (r, whole_peak, bound)
