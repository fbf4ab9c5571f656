"""Placement maps (issue 48's first part): ``StarTrailGroups.create(placement=map)`` with any
permutation of the CP ranks as the map from logical rank ``team*C + member`` to CP rank.

* Several ranks: out and every gradient match float64 attention for random maps (causal
  GQA, full attention with sinks at C = 3, a sliding window with soft-capping, packed
  documents, the 2-D split with a map over its ring group).
* Proof the map ran: every collective's members are the map's team, every K,V step goes to
  the map's sub-ring neighbour, and both differ from the team placement's.
* A map that is not a permutation (a rank lost or repeated) is a ``ValueError`` naming the
  placement, on every rank, before any group is made.
The pure arithmetic of maps (coordinates, peers, causal balance) is in ``test_layout.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from common import (
    TOL,
    assert_matches_reference,
    make_inputs,
    packed_inputs,
    packed_reference,
    reference,
    shard,
)
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.schedule.layout import StarTrailLayout
from startrail_megatron.schedule.packing import pack_lengths

S_LOCAL, D = 12, 8


def _map(p: int, seed: int) -> tuple[int, ...]:
    ranks = list(range(p))
    random.Random(seed).shuffle(ranks)
    return tuple(ranks)


def _groups(c, u, placement):
    if u == 1:
        return st.StarTrailGroups.create(c, placement=placement)
    return st.UlyssesStarTrailGroups.create(u, c, placement=placement)


def _map_rank(rank, world, c, u, placement, causal, heads, window, cap, sinks_on):
    hq, hkv = heads
    groups = _groups(c, u, placement)
    lay = groups.layout.ring if u > 1 else groups.layout
    q, k, v, do = make_inputs(5, S_LOCAL * world, 1, hq, hkv, D)
    zig = causal or window is not None
    local = [shard(x, rank, world, zig).requires_grad_() for x in (q, k, v)]
    sinks = torch.linspace(-1, 1, hq, dtype=torch.float64).requires_grad_() if sinks_on else None
    ledger = st.CommLedger()
    out = st.startrail_attention(
        *local, groups, causal=causal, kernel="torch", window=window, softcap=cap,
        sinks=sinks, ledger=ledger,
    )  # fmt: skip
    out.backward(shard(do, rank, world, zig))
    import torch.distributed as dist

    sg = groups.startrail if u > 1 else groups  # StarTrail's groups (the ring group's)
    me = sg.cp_rank

    def global_of(x: int) -> int:
        return x if sg.cp_group is None else dist.get_global_rank(sg.cp_group, x)

    teams = {e.group for e in ledger.events if e.kind == "collective" and e.op != "all_to_all"}
    kv_to = {e.peer for e in ledger.events if e.what == "kv"}
    want_team = tuple(global_of(x) for x in lay.team_ranks(lay.coord(me)[0]))
    proof = {
        "teams": teams,
        "want_team": want_team,
        "kv_to": kv_to,
        "ring_next": lay.ring_next(me),
        "team_placement_next": StarTrailLayout(lay.cp_size, lay.team_size).ring_next(me),
    }
    grads = [out.detach(), *(x.grad for x in local)]
    return grads, None if sinks is None else sinks.grad, proof


CASES = [
    pytest.param(8, 2, 1, _map(8, 1), True, (4, 2), None, None, False, id="P8-C2-causal-gqa"),
    pytest.param(9, 3, 1, _map(9, 2), False, (3, 3), None, None, True, id="P9-C3-full-sinks"),
    pytest.param(8, 2, 1, _map(8, 3), True, (4, 2), (6, 0), 2.0, False, id="P8-C2-window-softcap"),
    pytest.param(8, 2, 2, _map(4, 4), True, (4, 2), None, None, False, id="P8-U2-C2-ring-map"),
]


@pytest.mark.parametrize("p,c,u,placement,causal,heads,window,cap,sinks", CASES)
def test_a_map_is_exact_and_runs_its_teams_and_rings(
    p, c, u, placement, causal, heads, window, cap, sinks
):
    res = run_ranks(p, _map_rank, c, u, placement, causal, heads, window, cap, sinks)
    hq, hkv = heads
    q, k, v, do = make_inputs(5, S_LOCAL * p, 1, hq, hkv, D)
    ref_sinks = torch.linspace(-1, 1, hq, dtype=torch.float64) if sinks else None
    ref = reference(q, k, v, do, causal, window=window, softcap=cap, sinks=ref_sinks)
    zig = causal or window is not None
    assert_matches_reference(res, ref[:4], zig, torch.float64, TOL[torch.float64])
    if sinks:
        assert (sum(r[1] for r in res) - ref[4]).abs().max().item() < TOL[torch.float64]
    moved_off_team = 0
    for r, (_, _, proof) in enumerate(res):
        assert proof["teams"] <= {proof["want_team"]}, (r, proof)  # the map's team only
        if window is None and proof["kv_to"]:  # every K,V step to the map's neighbour
            assert proof["kv_to"] == {proof["ring_next"]}, (r, proof)
            moved_off_team += proof["ring_next"] != proof["team_placement_next"]
    if window is None and c * c < (p // u):  # sub-rings exist: the map moved some hop
        assert moved_off_team > 0


def _packed_rank(rank, world, placement, lengths):
    lay = pack_lengths(lengths, world)
    q, k, v, do = packed_inputs(lengths, 1, 4, 2, D, 3)
    local = [st.shard_packed(x, lay, rank).requires_grad_() for x in (q, k, v)]
    out = st.startrail_attention(
        *local, st.StarTrailGroups.create(2, placement=placement), causal=True, kernel="torch",
        cu_seqlens=lay.cu_seqlens, cu_seqlens_padded=lay.cu_seqlens_padded,
    )  # fmt: skip
    out.backward(st.shard_packed(do, lay, rank))
    return [out.detach(), *(x.grad for x in local)]


def test_a_map_with_packed_documents():
    """Packed documents under a random map (P = 8, C = 2): each document's real rows match
    its float64 reference."""
    p, lengths = 8, (37, 16, 51)
    res = run_ranks(p, _packed_rank, _map(8, 5), lengths)
    want = packed_reference(lengths, True, 1, 4, 2, D, 3)
    lay = pack_lengths(lengths, p)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = st.unshard_packed([r[i] for r in res], lay)
        err = st.testing.rel_err(got, want[i])
        assert err <= TOL[torch.float64], (what, err)


def _bad_map(rank, world, placement):
    try:
        st.StarTrailGroups.create(2, placement=placement)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "placement,match",
    [
        ((0, 1, 2, 2), r"placement map \(0, 1, 2, 2\) is not a permutation of the 4 CP ranks"),
        ((3, 1, 0), r"placement map \(3, 1, 0\) is not a permutation of the 4 CP ranks"),
        ("node", r"placement='node' is not known; allowed: \['team', 'ring'\] or a map"),
    ],
)
def test_a_map_that_loses_a_rank_is_refused_before_any_group(placement, match):
    import re

    for msg in run_ranks(4, _bad_map, placement):
        assert msg is not None and re.search(match, msg), msg
