"""The attention's tile (``startrail_attention(tile=)``, ``--startrail-attention-tile``).

* ``schedule.tile_calls`` keeps every (query, key) pair of a step exactly once and bounds
  each call by the tile (rows; keys too but for band calls), on dense, causal, windowed
  and own-rows-first plans.
* Several ranks (torch.distributed): out and every gradient match float64 attention with
  tiles that do not divide the calls, causal and full, GQA, a window with soft-capping,
  sinks, packed documents; the kernel's largest call is at most the tile (and is larger
  without it: the tile ran).
* Bad tiles are a ``ValueError`` naming the setting, before any transfer.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from common import assert_dense_parity, dense_rank_inputs, groups_for, make_inputs, shard
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.kernels import TorchKernel
from startrail_megatron.one_process import one_process_attention
from startrail_megatron.schedule import (
    StarTrailLayout,
    band_pairs,
    normalize_window,
    plan_step,
    startrail_active_steps,
    tile_calls,
)
from startrail_megatron.schedule.packing import PackedLayout
from startrail_megatron.zigzag import shard_packed

S_LOCAL, BATCH, D = 12, 1, 8


def _pairs(call) -> set:
    """The (team row, team key) pairs of a row call."""
    out = set()
    for i in range(call.nq):
        for j in range(call.nk):
            if call.band is not None:
                lo, hi = call.band
                if (lo is not None and j - i < lo) or (hi is not None and j - i > hi):
                    continue
            elif call.causal and j > i:
                continue
            out.add((call.q_lo + i, call.kv_lo + j))
    return out


def _all_pairs(calls) -> list:
    return [p for c in calls for p in _pairs(c)]


@pytest.mark.parametrize("tile", [1, 3, 5, 7, 24, 100])
@pytest.mark.parametrize(
    "p,c,causal,window",
    [(4, 2, True, None), (8, 2, False, None), (8, 2, True, (5, 0)), (9, 3, True, None),
     (8, 2, False, (3, 2))],
)  # fmt: skip
def test_tiles_keep_every_pair_once_and_bound_each_call(p, c, causal, window, tile):
    lay = StarTrailLayout(p, c, "team")
    band = None if window is None else normalize_window(window, p * S_LOCAL, causal)
    for r in range(p):
        for step in lay.computed_steps(r, startrail_active_steps(lay, causal, S_LOCAL, band)):
            for own_first in (False, True) if band is None else (False,):
                kw = dict(causal=causal, s_local=S_LOCAL, window=band, own_first=own_first)
                whole = plan_step(lay, r, step, **kw)
                tiled = plan_step(lay, r, step, tile=tile, **kw)
                want = _all_pairs(whole.row_calls)
                got = _all_pairs(tiled.row_calls)
                assert len(got) == len(set(got)) == len(want) and set(got) == set(want)
                for call in tiled.row_calls:
                    assert call.nq <= tile, (call, tile)
                    if call.band is None:
                        assert call.nk <= tile, (call, tile)
                    else:
                        assert call.pairs() == band_pairs(call.nq, call.nk, *call.band)
                # own calls keep their shift: their local rows are the same queries
                for own in tiled.own:
                    assert own.local_q_rows.stop - own.local_q_rows.start == own.call.nq
    assert tile_calls((), tile) == ()


class _Largest(TorchKernel):
    """The reference kernel, recording the largest call it ran in each direction."""

    def __init__(self):
        super().__init__()
        self.largest = {"fwd": (0, 0), "bwd": (0, 0)}

    def _see(self, way, q, k):
        a, b = self.largest[way]
        self.largest[way] = (max(a, q.shape[0]), max(b, k.shape[0]))

    def forward(self, q, k, v, **kw):
        self._see("fwd", q, k)
        return super().forward(q, k, v, **kw)

    def backward(self, do, q, k, v, *a, **kw):
        self._see("bwd", q, k)
        return super().backward(do, q, k, v, *a, **kw)


def _tiled_rank(rank, world, c, causal, hq, hkv, window, softcap, sinks_on, tile):
    groups = groups_for(c)
    local, dout, sinks = dense_rank_inputs(
        rank, world, S_LOCAL, BATCH, (hq, hkv), D, causal, window, sinks_on
    )
    kern = _Largest()
    ledger = st.CommLedger()
    out = st.startrail_attention(
        *local, groups, causal=causal, kernel=kern, window=window, softcap=softcap,
        sinks=sinks, tile=tile, ledger=ledger,
    )  # fmt: skip
    out.backward(dout)
    grads = [out.detach(), *(x.grad for x in local)]
    return grads, (None if sinks is None else sinks.grad), kern.largest, len(ledger.events)


TILED = [
    pytest.param(4, 2, True, (8, 2), None, None, False, id="P4-C2-causal-gqa"),
    pytest.param(8, 2, False, (4, 4), None, None, False, id="P8-C2-full"),
    pytest.param(8, 2, True, (4, 2), (5, 0), 2.0, True, id="P8-C2-window-softcap-sinks"),
]


@pytest.mark.parametrize("p,c,causal,heads,window,cap,sinks", TILED)
def test_tiled_attention_matches_fp64_and_the_tile_ran(p, c, causal, heads, window, cap, sinks):
    hq, hkv = heads
    tile = 5  # divides neither the chunks (6) nor the team rows (24)
    res = run_ranks(p, _tiled_rank, c, causal, hq, hkv, window, cap, sinks, tile)
    whole = run_ranks(p, _tiled_rank, c, causal, hq, hkv, window, cap, sinks, None)
    assert_dense_parity(res, p, S_LOCAL, BATCH, heads, D, causal, window, cap, sinks)
    for r, (tiled_run, whole_run) in enumerate(zip(res, whole)):
        for way in ("fwd", "bwd"):
            assert tiled_run[2][way][0] <= tile, (r, way, tiled_run[2])
            if window is None:
                assert tiled_run[2][way][1] <= tile, (r, way, tiled_run[2])
        if window is None:  # without it: larger calls (a narrow window's are small anyway)
            assert max(whole_run[2]["bwd"]) > tile, (r, whole_run[2])
        assert tiled_run[3] == whole_run[3] > 0, r  # the same transfers


def test_tile_with_packed_documents_and_dropout_in_one_process():
    """Packed documents (per-document calls, tiled) and attention dropout (one record per
    tile, the backward replaying the forward's): the same as whole calls where dropout is
    off, and the dropout run reproducible with the same seed."""
    p, c, hq, hkv = 4, 2, 4, 2
    lengths = [40, 16, 40]  # padded to multiples of 2P = 8
    n = sum(lengths)
    q, k, v, do = make_inputs(5, n, 1, hq, hkv, D)
    cu = list(itertools.accumulate([0, *lengths]))
    layout = PackedLayout.create(p, cu)

    def run(tile, dropout_p=0.0, seed=0):
        leaves = [
            [shard_packed(x, layout, r).to(torch.float64).requires_grad_() for r in range(p)]
            for x in (q, k, v)
        ]
        torch.manual_seed(seed)
        outs = one_process_attention(
            *leaves, c, causal=True, cu_seqlens=cu, tile=tile, dropout_p=dropout_p,
            kernel="torch",
        )  # fmt: skip
        torch.autograd.backward(outs, [shard_packed(do, layout, r).double() for r in range(p)])
        return [torch.cat(outs)] + [torch.cat([x.grad for x in xs]) for xs in leaves]

    whole, tiled = run(None), run(3)
    for a, b in zip(whole, tiled):
        assert (a - b).abs().max().item() < 1e-12
    d1, d2 = run(3, 0.3, seed=7), run(3, 0.3, seed=7)
    for a, b in zip(d1, d2):
        assert torch.equal(a, b)
    assert (d1[0] - tiled[0]).abs().max().item() > 1e-3  # dropout ran


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "64"])
def test_bad_tile_is_refused_by_name_before_any_transfer(bad):
    q, k, v, _ = make_inputs(0, 16, 1, 2, 2, 4)
    shards = [[shard(x, r, 2, True).double() for r in range(2)] for x in (q, k, v)]
    ledgers = [st.CommLedger() for _ in range(2)]
    with pytest.raises(ValueError, match=r"tile=.* must be None \(whole calls\) or an integer"):
        one_process_attention(*shards, 1, tile=bad, ledgers=ledgers)
    assert all(not led.events for led in ledgers)
