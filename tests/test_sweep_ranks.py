"""A seeded random sweep over what the adapters hand ``startrail_attention`` on real ranks
(4 and 8 gloo ranks, one worker pool): the 2-D split's U (dividing or not, with the heads
it needs or not), the team size C over the R = P / U ring ranks (valid or not), the
placement (named, a random map of the ring ranks, or neither), packed documents (random
lengths, empty ones included) or dense tokens, causal or not, a window, GQA, head chunks
(dividing the ring rank's KV heads or not), float64 / float32. Each case is either exact
against the one-device float64 reference (out and every gradient) or a ``ValueError`` on
every rank before any transfer (every rank's ledger empty; a rank that did not raise would
hang its peers, ended by the harness' deadline). ``test_sweep.py`` sweeps the kernel-side
arguments (windows, soft-capping, sinks, tiles) in one process.
"""

from __future__ import annotations

import random

import pytest
import torch
from common import make_inputs, noisy_packed_shards, reference, rel_err_floor1, shard, unshard
from harness import run_ranks

import startrail_megatron as st
from startrail_megatron.schedule.layout import valid_team_sizes
from startrail_megatron.schedule.packing import pack_lengths

CASES = {4: 48, 8: 48}
TOL = {torch.float64: 1e-10, torch.float32: 3e-5}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _case(rng: random.Random, p: int) -> dict:
    u = 3 if rng.random() < 0.1 else rng.choice([d for d in _divisors(p) if d <= 4])
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 4])
    split_ok = p % u == 0 and hq % u == 0 and (hkv % u == 0 or u % hkv == 0)
    ring = p // u if p % u == 0 else p
    valid_c = valid_team_sizes(ring)
    bad_c = rng.random() < 0.15
    c = rng.choice([x for x in (2, 3, 4) if x not in valid_c] or [ring + 1]) if bad_c else (
        rng.choice(valid_c)
    )  # fmt: skip
    ranks = list(range(ring))
    rng.shuffle(ranks)
    bad_placement = rng.random() < 0.1
    placement = (
        rng.choice(["rings", tuple(ranks[:-1] + ranks[:1]) if ring > 1 else (1,)])
        if bad_placement
        else rng.choice(["team", "ring", "team", tuple(ranks)])
    )
    packed = rng.random() < 0.4
    causal = rng.random() < 0.6
    window = None
    if not packed and rng.random() < 0.25:
        window = (rng.choice([1, 3, 9]), 0 if causal else rng.choice([0, 4]))
    kv_ring = max(hkv, u) // u if u > 1 else hkv
    draw = rng.random()
    chunks = None if draw < 0.4 else rng.choice(_divisors(kv_ring)) if draw < 0.88 else (
        rng.choice([0, kv_ring + 1])
    )  # fmt: skip
    bad_chunks = chunks is not None and (chunks < 1 or kv_ring % chunks != 0)
    return dict(
        u=u, c=c, placement=placement, hq=hq, hkv=hkv, causal=causal, window=window,
        packed=[rng.randint(0, 3 * p) for _ in range(rng.randint(1, 4))] if packed else None,
        s_local=2 * rng.randint(1, 3), b=rng.choice([1, 2]), d=rng.choice([4, 8]),
        head_chunks=chunks, dtype=rng.choice([torch.float64, torch.float64, torch.float32]),
        valid=split_ok and not (bad_c or bad_placement or bad_chunks),
    )  # fmt: skip


def _cases(p: int) -> list[dict]:
    rng = random.Random(20261205 + p)
    return [_case(rng, p) for _ in range(CASES[p])]


def _inputs(case: dict, p: int, seed: int):
    """The full float64 inputs and this layout's shards of them (per rank)."""
    if case["packed"] is not None:
        lengths = case["packed"]
        full = make_inputs(seed, sum(lengths), case["b"], case["hq"], case["hkv"], case["d"])
        return full, lambda r: noisy_packed_shards(full, lengths, p, r, case["dtype"])
    n = case["s_local"] * p
    full = make_inputs(seed, n, case["b"], case["hq"], case["hkv"], case["d"])
    zz = case["causal"] or case["window"] is not None
    return full, lambda r: [shard(x, r, p, zz).to(case["dtype"]) for x in full]


_GROUPS: dict = {}


def _groups(u: int, c: int, placement):
    key = (u, c, placement)
    if key not in _GROUPS:
        if u > 1:
            _GROUPS[key] = st.UlyssesStarTrailGroups.create(u, c, placement=placement)
        else:
            _GROUPS[key] = st.StarTrailGroups.create(c, placement=placement)
    return _GROUPS[key]


def _sweep(rank: int, world: int) -> list:
    out = []
    for i, case in enumerate(_cases(world)):
        ledger = st.CommLedger()
        _, shards = _inputs(case, world, seed=i)
        q, k, v, do = shards(rank)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        kw = {}
        if case["packed"] is not None:
            packed = pack_lengths(case["packed"], world)
            kw = dict(
                cu_seqlens=list(packed.cu_seqlens), cu_seqlens_padded=list(packed.cu_seqlens_padded)
            )
        try:
            groups = _groups(case["u"], case["c"], case["placement"])
            o = st.startrail_attention(
                *leaves, groups, causal=case["causal"], window=case["window"], ledger=ledger,
                head_chunks=case["head_chunks"], **kw,
            )  # fmt: skip
        except ValueError as e:
            out.append(("refused", str(e), len(ledger.events)))
            continue
        o.backward(do)
        out.append(("ran", [o.detach(), *(x.grad for x in leaves)], len(ledger.events)))
    return out


def _check(p: int, results: list) -> dict:
    counts = {"ran": 0, "refused": 0}
    for i, case in enumerate(_cases(p)):
        per_rank = [r[i] for r in results]
        kinds = {what for what, _, _ in per_rank}
        assert len(kinds) == 1, (i, case, per_rank)  # every rank refused, or none
        what = kinds.pop()
        counts[what] += 1
        if what == "refused":
            assert not case["valid"], (i, case, per_rank[0][1])  # a valid setting refused
            assert all(sent == 0 for _, _, sent in per_rank), (i, case, "a transfer first")
            continue
        assert case["valid"], (i, case, "an invalid setting was accepted")
        full, _ = _inputs(case, p, seed=i)
        if case["packed"] is not None:
            lengths = case["packed"]
            packed = pack_lengths(lengths, p)
            ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            ref = reference(*full, case["causal"], doc_ids=ids)
            got = [st.unshard_packed([r[1][j] for r in per_rank], packed) for j in range(4)]
        else:
            zz = case["causal"] or case["window"] is not None
            ref = reference(*full, case["causal"], window=case["window"])
            got = [unshard([r[1][j] for r in per_rank], zz) for j in range(4)]
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            err = rel_err_floor1(got[j], ref[j])
            assert err <= TOL[case["dtype"]], (i, case, name, err)
        assert any(sent for _, _, sent in per_rank) or p // case["u"] == 1, (i, case)
    return counts


@pytest.mark.parametrize("p", sorted(CASES))
def test_every_case_is_exact_or_refused_on_every_rank_before_any_transfer(p):
    counts = _check(p, run_ranks(p, _sweep, timeout=600))
    assert counts["ran"] >= CASES[p] // 4 and counts["refused"] >= 3, counts
    print(f"P = {p}: {counts['ran']} exact, {counts['refused']} refused of {CASES[p]}")
