"""Exhaustive tests of the pure rank arithmetic and the causal block plans."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from startrail_megatron.schedule import (
    BlockCall,
    RowCall,
    normalize_window,
    own_team_rows,
    plan_block,
    restrict_rows,
    split_own_rows,
    startrail_step_calls,
    startrail_step_rows,
    startrail_step_window_rows,
    team_chunk_len,
)
from startrail_megatron.schedule.layout import PLACEMENTS, StarTrailLayout, valid_team_sizes

ALL = [(p, c, pl) for p in range(1, 65) for c in valid_team_sizes(p) for pl in PLACEMENTS]


def random_maps(sizes, per: int = 3, seed: int = 48) -> list[tuple[int, int, tuple]]:
    """(P, C, map) cases: ``per`` seeded random permutations of the P CP ranks for each
    valid C > 1 of each P (a map is any assignment of logical ranks to CP ranks)."""
    rng = random.Random(seed)
    out = []
    for p in sizes:
        for c in valid_team_sizes(p)[1:]:
            for _ in range(per):
                ranks = list(range(p))
                rng.shuffle(ranks)
                out.append((p, c, tuple(ranks)))
    return out


MAPS = random_maps([4, 8, 9, 12, 16, 18, 24, 32, 36])
ALL += MAPS


def simulate_kv(lay: StarTrailLayout) -> list[list[int]]:
    """Move KV by the send rules alone; held[step][rank] = KV team held there."""
    p = lay.cp_size
    held = [None] * p
    for r in range(p):  # initial placement: r sends its team's KV
        held[lay.initial_send_peer(r)] = lay.coord(r)[0]
    steps = [list(held)]
    for _ in range(lay.ring_size - 1):
        nxt = [None] * p
        for r in range(p):
            nxt[lay.ring_next(r)] = steps[-1][r]
        steps.append(nxt)
    return steps


@pytest.mark.parametrize("p,c,pl", ALL)
def test_layout_exhaustive(p, c, pl):
    lay = StarTrailLayout(p, c, pl)
    t_n, g = lay.num_teams, lay.ring_size
    # coordinates are a bijection
    assert sorted(lay.rank(t, a) for t in range(t_n) for a in range(c)) == list(range(p))
    assert all(lay.rank(*lay.coord(r)) == r for r in range(p))
    # teams and sub-rings partition the ranks
    assert sorted(sum(lay.all_team_ranks(), [])) == list(range(p))
    assert sorted(sum(lay.all_subring_ranks(), [])) == list(range(p))
    assert len(lay.all_subring_ranks()) == c * c and all(
        len(s) == g for s in lay.all_subring_ranks()
    )
    if pl == "team":
        assert all(lay.team_ranks(t) == list(range(t * c, t * c + c)) for t in range(t_n))
    elif pl == "ring":
        assert all(s == list(range(s[0], s[0] + g)) for s in lay.all_subring_ranks())
    else:  # a map: logical rank t*C + a is CP rank pl[t*C + a]
        assert all(lay.rank(t, a) == pl[t * c + a] for t in range(t_n) for a in range(c))
    for r in range(p):
        # send and receive peers are inverse permutations
        assert lay.initial_recv_peer(lay.initial_send_peer(r)) == r
        assert lay.ring_prev(lay.ring_next(r)) == r
        nx = lay.ring_next(r)
        assert lay.coord(nx)[1] == lay.coord(r)[1]  # same member: same sub-ring
        assert lay.team_group(lay.coord(nx)[0]) == lay.team_group(lay.coord(r)[0])
    # forward: the simulated KV matches kv_team_at_step, and every (Q team, KV team)
    # pair is computed exactly once
    steps = simulate_kv(lay)
    pairs = Counter()
    for s, held in enumerate(steps):
        for r in range(p):
            assert held[r] == lay.kv_team_at_step(r, s)
            pairs[(lay.coord(r)[0], held[r])] += 1
    assert pairs == Counter({(a, b): 1 for a in range(t_n) for b in range(t_n)})
    # backward: after step G-1 each rank returns the copy it holds to its origin
    origin_at_end = {}
    for r in range(p):
        holder = r
        holder = lay.initial_send_peer(holder)
        for _ in range(g - 1):
            holder = lay.ring_next(holder)
        origin_at_end[holder] = r
    for r in range(p):
        send_to, recv_from = lay.dkv_return_peers(r)
        assert send_to == origin_at_end[r]
        assert origin_at_end[recv_from] == r
    # team chunks: zigzag chunk ids of its members' ranks, sorted
    all_chunks = sorted(x for t in range(t_n) for x in lay.team_chunks(t))
    assert all_chunks == list(range(2 * p))
    for t in range(t_n):
        gathered = [x for r in lay.team_ranks(t) for x in (r, 2 * p - 1 - r)]
        assert [gathered[i] for i in lay.team_chunk_order(t)] == lay.team_chunks(t)


def test_team_placement_is_fronts_then_backs():
    lay = StarTrailLayout(16, 2, "team")
    assert lay.team_chunks(3) == [6, 7, 24, 25]  # [tC, tC+C) and [2P-C-tC, 2P-tC)


@pytest.mark.parametrize(
    "p,c,placement,match",
    [
        (8, 3, "team", "team_size=3 does not fit context-parallel size 8"),
        (8, 0, "team", "team_size must be an integer >= 1"),
        (12, 4, "team", r"allowed team sizes for 12: \[1, 2\]"),
        (8, 2, "rings", r"placement='rings' is not known; allowed: \['team', 'ring'\] or a map"),
        (0, 1, "team", "context-parallel size must be an integer >= 1"),
        (4, 2, (0, 1, 2, 2), r"placement map \(0, 1, 2, 2\) is not a permutation of the 4 CP"),
        (4, 2, (0, 1, 2), r"placement map \(0, 1, 2\) is not a permutation of the 4 CP"),
        (4, 2, (0, 1, 2, 4), r"is not a permutation of the 4 CP ranks 0..3 \(each once\)"),
        (4, 2, (0.0, 1, 2, 3), r"placement=\(0.0, 1, 2, 3\) is not known; allowed: \['team'"),
    ],
)
def test_layout_rejects_bad_settings(p, c, placement, match):
    with pytest.raises(ValueError, match=match):
        StarTrailLayout(p, c, placement)


def _brute_mask(q_chunks, kv_chunks, c):
    """Token-level causal visibility of a block: set of (q row, kv row)."""
    vis = set()
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(kv_chunks):
            for x in range(c):
                for y in range(c):
                    if kc * c + y <= qc * c + x:
                        vis.add((i * c + x, j * c + y))
    return vis


PLAN_CASES = [(p, c, pl) for p in range(1, 33) for c in valid_team_sizes(p) for pl in PLACEMENTS]
PLAN_CASES += random_maps([4, 8, 9, 16, 18, 32], per=2, seed=7)


@pytest.mark.parametrize("p,c,pl", PLAN_CASES)
def test_causal_plans_cover_exactly_and_balance(p, c, pl):
    lay = StarTrailLayout(p, c, pl)
    chunk = 2  # tokens per chunk: diagonals are then real triangles
    n = 2 * c * chunk  # team tokens
    for tq in range(lay.num_teams):
        for tk in range(lay.num_teams):
            qc, kc = lay.team_chunks(tq), lay.team_chunks(tk)
            calls = plan_block(qc, kc, True)
            got = Counter()
            for call in calls:
                rows = range(call.q_lo * chunk, call.q_hi * chunk)
                cols = range(call.kv_lo * chunk, call.kv_hi * chunk)
                cells = [(x, y) for x in rows for y in cols]
                if call.causal:
                    assert call.q_hi - call.q_lo == call.kv_hi - call.kv_lo
                    cells = [(x, y) for x, y in cells if y - cols[0] <= x - rows[0]]
                assert cells, "a call must never be fully masked"
                got.update(cells)
            want = _brute_mask(qc, kc, chunk)
            assert set(got) == want and all(v == 1 for v in got.values())
            if tq != tk:  # off-diagonal blocks: exactly half of the pairs
                assert sum(call.pairs(chunk) for call in calls) == n * n // 2
            if pl == "team":
                assert len(calls) <= 3
    # per-rank causal work: G*n^2/2, plus n/2 on the one member holding its own team
    for r in range(p):
        t = lay.coord(r)[0]
        work = sum(
            call.pairs(chunk)
            for s in range(lay.ring_size)
            for call in plan_block(
                lay.team_chunks(t), lay.team_chunks(lay.kv_team_at_step(r, s)), True
            )
        )
        own = any(lay.kv_team_at_step(r, s) == t for s in range(lay.ring_size))
        assert work == lay.ring_size * n * n // 2 + own * n // 2


@pytest.mark.parametrize("p,c,pl", PLAN_CASES)
def test_step_calls_are_the_blocks_of_the_schedule(p, c, pl):
    """Rank r at step s: its team's q against the KV team it holds then; full: one call."""
    lay = StarTrailLayout(p, c, pl)
    for r in range(p):
        t = lay.coord(r)[0]
        for s in range(lay.ring_size):
            kv = lay.kv_team_at_step(r, s)
            want = plan_block(lay.team_chunks(t), lay.team_chunks(kv), True)
            assert startrail_step_calls(lay, r, s, True) == tuple(want)
            assert startrail_step_calls(lay, r, s, False) == (BlockCall(0, 1, 0, 1, False),)
    # chunk units: zigzag chunks of s/2 tokens (causal), the whole team buffer (full)
    assert team_chunk_len(lay, 8, True) == 4 and team_chunk_len(lay, 8, False) == 8 * c


def test_full_mask_is_one_call():
    calls = plan_block([0, 1, 6, 7], [2, 3, 4, 5], False)
    assert len(calls) == 1 and not calls[0].causal


def test_p2p_message_counts():
    # P = 8, C = 2: ranks (0,0) and (3,1) are a first holder of their own team's KV, so
    # they send their own K,V to one rank only (their partner); the others to two.
    lay = StarTrailLayout(8, 2)
    fwd = [lay.p2p_sends(r, backward=False) for r in range(8)]
    assert [f["kv_place"] for f in fwd] == [1, 2, 2, 2, 2, 2, 2, 1]
    assert all(f["kv"] == 1 for f in fwd)  # one sub-ring step
    ring = StarTrailLayout(8, 1)
    want = {"kv": 7, "kv_place": 0, "dkv": 7, "dkv_home": 1}
    assert all(ring.p2p_sends(r, backward=True) == want for r in range(8))


@pytest.mark.parametrize(
    "p,c,placement",
    [(4, 2, "team"), (8, 2, "team"), (8, 2, "ring"), (16, 4, "team"), (18, 3, "ring"),
     (32, 2, "ring"), (64, 4, "team"), (9, 1, "team")],
)  # fmt: skip
def test_direct_placement_and_home_are_the_papers_transfers(p, c, placement):
    """Each member's K,V sent straight to the C first holders of its team's KV gives every
    rank the team KV the paper's placement gives it (``initial_recv_peer``'s team), one
    piece per member; and the dK/dV parts sent home reach each member from the C final
    holders of its team's copies."""
    lay = StarTrailLayout(p, c, placement)
    pairs_out = {(r, d) for r in range(p) for d in lay.placement_targets(r)}
    pairs_in = {(src, r) for r in range(p) for src in lay.placement_sources(r)}
    assert pairs_out == pairs_in and len(pairs_out) == p * c
    g = lay.ring_size
    for r in range(p):
        t, a = lay.coord(r)
        assert lay.placement_sources(r) == lay.team_ranks(lay.coord(lay.initial_recv_peer(r))[0])
        assert sorted(lay.placement_targets(r)) == sorted(
            lay.initial_send_peer(lay.rank(t, m)) for m in range(c)
        )
        for copy in range(c):  # copy `copy` of team t: its first holder, G-1 steps on
            holder = lay.initial_send_peer(lay.rank(t, copy))
            for _ in range(g - 1):
                holder = lay.ring_next(holder)
            assert lay.dkv_home_sources(r)[copy] == holder
            assert lay.dkv_home_targets(holder) == lay.team_ranks(t)


@pytest.mark.parametrize(
    "p,c,placement,w",
    [(8, 1, "team", 3), (8, 1, "team", 12), (9, 1, "ring", 8), (16, 2, "team", 3),
     (16, 2, "ring", 1), (32, 2, "team", 12), (32, 2, "ring", 3), (18, 3, "ring", 3),
     (18, 3, "team", 1), (64, 4, "team", 33), (64, 4, "ring", 3)],
)  # fmt: skip
def test_skipping_idle_steps_moves_each_copy_where_it_is_computed(p, c, placement, w):
    """Under a narrow window (``startrail_active_steps``) each KV copy goes straight to the
    rank that holds it at its sub-ring's first computed step, jumps past idle steps
    (``ring_shift``), and its dK/dV goes home from the holder at the last computed step:
    the same KV at every computed step as the full schedule, each copy received once."""
    from startrail_megatron.schedule import startrail_active_steps, startrail_step_window_rows

    lay = StarTrailLayout(p, c, placement)
    s_local = 8
    active = startrail_active_steps(lay, True, s_local, (w - 1, None))
    assert active is not None  # some sub-ring has idle steps here
    g = lay.ring_size
    pairs_out = {(r, d) for r in range(p) for d in lay.placement_targets(r, active)}
    pairs_in = {(src, r) for r in range(p) for src in lay.placement_sources(r, active)}
    assert pairs_out == pairs_in and len(pairs_out) == p * c
    for r in range(p):
        steps = lay.computed_steps(r, active)
        assert list(steps) == sorted(set(steps)) and 0 <= steps[0] and steps[-1] < g
        ring = lay.subring_ranks(*divmod(lay.subring_index(r), c))
        for step in range(g):  # a skipped step: no rank of the sub-ring has a call in it
            busy = any(startrail_step_window_rows(lay, x, step, True, s_local, (w - 1, None))
                       for x in ring)  # fmt: skip
            assert busy == (step in steps) or (not busy and steps == (0,)), (r, step)
        # the KV held at each computed step is the full schedule's (kv_team_at_step)
        held = lay.placement_sources(r, active)
        assert held == lay.team_ranks(lay.kv_team_at_step(r, steps[0]))
        for a, b in zip(steps, steps[1:]):  # a jump of b - a hops: received from there
            src = lay.ring_shift(r, -(b - a))
            assert lay.computed_steps(src, active) == steps
            assert lay.kv_team_at_step(src, a) == lay.kv_team_at_step(r, b)
        assert lay.dkv_home_targets(r, active) == lay.team_ranks(lay.kv_team_at_step(r, steps[-1]))
        t = lay.coord(r)[0]
        srcs = lay.dkv_home_sources(r, active)
        assert len(set(srcs)) == c
        for y in srcs:
            assert r in lay.dkv_home_targets(y, active)
            assert lay.kv_team_at_step(y, lay.computed_steps(y, active)[-1]) == t
        sends = lay.p2p_sends(r, backward=True, active=active)
        full = lay.p2p_sends(r, backward=True)
        assert sends["kv"] == sends["dkv"] == len(steps) - 1 <= full["kv"]
    # some rank sends fewer sub-ring messages than the full schedule
    assert any(len(lay.computed_steps(r, active)) < g for r in range(p))


def test_windows_without_idle_steps_run_every_step():
    from startrail_megatron.schedule import startrail_active_steps

    for p, c, pl, w in ((8, 1, "team", 33), (16, 2, "ring", 3), (32, 2, "ring", 8)):
        lay = StarTrailLayout(p, c, pl)
        assert startrail_active_steps(lay, True, 8, (w - 1, None)) is None
        assert startrail_active_steps(lay, True, 8, None) is None
        assert lay.computed_steps(0, None) == tuple(range(lay.ring_size))


def _call_pairs(call: RowCall) -> Counter:
    """(team q row, team kv row) pairs of a ``RowCall`` (plain, causal or banded)."""
    qa, qb, ka, kb = call.q_lo, call.q_hi, call.kv_lo, call.kv_hi
    cells = Counter()
    for i in range(qb - qa):
        for j in range(kb - ka):
            if call.band is not None:
                lo, hi = call.band
                ok = (lo is None or j - i >= lo) and (hi is None or j - i <= hi)
            else:
                ok = not call.causal or j <= i
            if ok:
                cells[qa + i, ka + j] += 1
    return cells


SPLIT_CASES = [
    (p, c, pl) for p in range(2, 17) for c in valid_team_sizes(p) if c > 1 for pl in PLACEMENTS
]


@pytest.mark.parametrize("p,c,pl", SPLIT_CASES)
def test_own_rows_first_split_keeps_every_pair(p, c, pl):
    """The first step's split (``split_own_rows``): the calls on a rank's own query rows and
    those on the others together make exactly the step's pairs, each once; the own part
    reads only the rank's own rows, at the local rows ``own_team_rows`` names (checked
    against the team order ``to_team_order`` uses), and every own-row call is non-empty."""
    lay = StarTrailLayout(p, c, pl)
    s = 4  # local tokens: zigzag chunks of 2
    windows = [None, (3, 0), (1, 2)]
    for causal in (True, False):
        for r in range(p):
            team, m = lay.coord(r)
            runs = own_team_rows(lay, r, causal, s)
            # where the all-gather puts this rank's local row x, after the team reorder
            order = lay.team_chunk_order(team) if causal else list(range(2 * c))
            chunk = s // 2
            src = [i * chunk + y for i in order for y in range(chunk)]  # team row -> member row
            mine = {t: src[t] - m * s for t in range(c * s) if m * s <= src[t] < (m + 1) * s}
            got = {lo + x: loc + x for lo, hi, loc in runs for x in range(hi - lo)}
            assert got == mine, (r, runs)
            for w in windows:
                for step in range(lay.ring_size):
                    if w is None:
                        calls = startrail_step_rows(lay, r, step, causal, s)
                    else:
                        band = normalize_window(w, p * s, causal)
                        calls = startrail_step_window_rows(lay, r, step, causal, s, band)
                    own, rest = split_own_rows(calls, runs)
                    want = sum((_call_pairs(x) for x in calls), Counter())
                    got_own = sum((_call_pairs(o.call) for o in own), Counter())
                    got_rest = sum((_call_pairs(x) for x in rest), Counter())
                    assert got_own + got_rest == want
                    assert all(q in mine for q, _ in got_own) and not any(
                        q in mine for q, _ in got_rest
                    )
                    for o in own:
                        x, shift = o.call, o.shift
                        assert _call_pairs(x), x  # no empty call
                        assert all(mine[t] == t + shift for t in range(x.q_lo, x.q_hi))
                        if x.causal:
                            assert x.nq == x.nk  # causal calls stay square


def test_restrict_rows_keeps_exactly_the_pairs_of_those_rows():
    """``restrict_rows`` on every row range of small causal, full and band calls (also
    ranges cutting a band call, which the dense schedule never makes)."""
    calls = [RowCall(2, 6, 10, 14, True), RowCall(0, 5, 3, 6, False), RowCall(1, 4, 1, 4, True)]
    calls += [
        RowCall(3, 9, 0, 7, band=(lo, hi)) for lo in (None, -4, -1, 0, 2) for hi in (None, -2, 0, 3)
    ]
    for call in calls:
        whole = _call_pairs(call)
        for lo in range(0, 11):
            for hi in range(lo, 12):
                pieces = restrict_rows(call, lo, hi)
                got = sum((_call_pairs(x) for x in pieces), Counter())
                assert got == Counter({k: v for k, v in whole.items() if lo <= k[0] < hi})
                assert all(_call_pairs(x) for x in pieces) and len(pieces) <= 2
