"""A seeded random sweep over ``one_process_attention``'s settings (every rank of a CP group
in this process, the same code as the multi-rank path: ``test_one_process.py`` proves the
bits equal): CP size, team size (valid or not), placement (named, a random map of the CP
ranks, or neither: unknown, a map that loses a rank), causal, query and
KV heads (dividing or not), local length, batch, head size, window, soft-capping, sinks,
dtype, the attention's tile (valid or not). Each case is either exact against the float64 reference (out and every gradient) or
a ``ValueError`` raised before any transfer (every rank's ledger empty), and it is the one
the settings call for: a valid setting refused, or an invalid one accepted, fails.
"""

from __future__ import annotations

import random

import pytest
import torch
from common import make_inputs, reference, rel_err_floor1, shard, unshard

import startrail_megatron as st
from startrail_megatron.one_process import one_process_attention
from startrail_megatron.schedule.layout import valid_team_sizes

CASES = 240


TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _case(rng: random.Random) -> dict:
    p = rng.choice([1, 2, 3, 4, 8, 9, 12, 16])
    valid = valid_team_sizes(p)
    bad_c = rng.random() < 0.1
    c = (
        rng.choice([x for x in range(2, 5) if x not in valid] or [p + 1])
        if bad_c
        else rng.choice(valid)
    )
    hkv = rng.choice([1, 2, 3])
    bad_heads = rng.random() < 0.1
    hq = hkv * rng.choice([1, 2]) + (1 if bad_heads and hkv > 1 else 0)
    bad_heads = hq % hkv != 0
    bad_placement = rng.random() < 0.08
    causal = rng.random() < 0.6
    window = None
    if rng.random() < 0.3:
        window = (rng.choice([-1, 0, 1, 3, 7]), 0 if causal else rng.choice([-1, 0, 2, 5]))
    zigzag = causal or window is not None
    tile = rng.choice([None, None, 1, 2, 3, 5, 0 if rng.random() < 0.5 else 2.5])
    bad_tile = tile is not None and (not isinstance(tile, int) or tile < 1)
    ranks = list(range(p))
    rng.shuffle(ranks)  # a placement map: any permutation of the CP ranks
    lost = tuple(ranks[:-1] + ranks[:1]) if p > 1 else (1,)  # one rank lost, one twice
    return dict(
        p=p,
        c=c,
        placement=(
            rng.choice(["node", "rings", lost])
            if bad_placement
            else rng.choice(["team", "ring", tuple(ranks)])
        ),
        causal=causal,
        hq=hq,
        hkv=hkv,
        s_local=2 * rng.randint(1, 3) if zigzag else rng.randint(1, 5),
        b=rng.choice([1, 2]),
        d=rng.choice([4, 8]),
        window=window,
        softcap=rng.choice([None, None, 1.5, -1.0 if rng.random() < 0.3 else 3.0]),
        sinks=rng.random() < 0.2,
        dtype=rng.choice([torch.float64, torch.float64, torch.float32]),
        tile=tile,
        valid_expected=not (bad_c or bad_heads or bad_placement or bad_tile),
    )


def _run(case: dict, seed: int):
    p, causal, window = case["p"], case["causal"], case["window"]
    zigzag = causal or window is not None
    n = case["s_local"] * p
    full = make_inputs(seed, n, case["b"], case["hq"], case["hkv"], case["d"])
    shards = [[shard(x, r, p, zigzag).to(case["dtype"]) for r in range(p)] for x in full]
    leaves = [[x.clone().requires_grad_() for x in xs] for xs in shards[:3]]
    sinks = None
    if case["sinks"]:
        sinks = torch.linspace(-1, 1, case["hq"], dtype=case["dtype"]).requires_grad_()
    ledgers = [st.CommLedger() for _ in range(p)]
    kw = dict(window=window, softcap=case["softcap"], sinks=sinks, tile=case.get("tile"))
    try:
        outs = one_process_attention(
            *leaves, case["c"], placement=case["placement"], causal=causal, ledgers=ledgers, **kw
        )
    except ValueError as e:
        return "refused", str(e), [list(led.events) for led in ledgers]
    torch.autograd.backward(outs, shards[3])
    got = [outs, *[[x.grad for x in xs] for xs in leaves]]
    ref_sinks = sinks.detach().double() if sinks is not None else None
    ref = reference(*full, causal, window=window, softcap=case["softcap"], sinks=ref_sinks)
    errs = {
        name: rel_err_floor1(unshard([t.detach() for t in g], zigzag), r)
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)
    }
    if sinks is not None:
        errs["dsinks"] = rel_err_floor1(sinks.grad, ref[4])
    return "ran", errs, [list(led.events) for led in ledgers]


def test_every_case_is_exact_or_refused_before_any_transfer():
    rng = random.Random(20261205)
    counts = {"ran": 0, "refused": 0}
    for i in range(CASES):
        case = _case(rng)
        expect_valid = case["valid_expected"] and (case["softcap"] is None or case["softcap"] > 0)
        what, detail, events = _run(case, seed=i)
        counts[what] += 1
        if what == "refused":
            assert not expect_valid, (i, case, detail)  # a valid setting refused
            assert all(e == [] for e in events), (i, case, "a transfer before the refusal")
        else:
            assert expect_valid, (i, case, "an invalid setting was accepted")
            worst = max(detail.values())
            assert worst <= TOL[case["dtype"]], (i, case, detail)
            if case["p"] > 1 and case["window"] is None:  # the CP group moved data
                assert any(events), (i, case)
    assert counts["ran"] >= CASES // 2 and counts["refused"] >= 8, counts
    print(f"sweep: {counts['ran']} exact, {counts['refused']} refused of {CASES}")


@pytest.mark.parametrize("setting", ["team_size", "placement", "heads", "tile"])
def test_the_sweep_sees_a_wrong_acceptance(setting, monkeypatch):
    """The oracle can fail: a case the settings call invalid that ran would be reported."""
    case = {
        "p": 4, "c": 2, "placement": "team", "causal": True, "hq": 2, "hkv": 1, "s_local": 2,
        "b": 1, "d": 4, "window": None, "softcap": None, "sinks": False,
        "dtype": torch.float64, "valid_expected": True,
    }  # fmt: skip
    case.update({"team_size": {"c": 3}, "placement": {"placement": "node"},
                 "heads": {"hq": 3, "hkv": 2}, "tile": {"tile": 0}}[setting])  # fmt: skip
    what, detail, events = _run(case, seed=0)
    assert what == "refused" and all(e == [] for e in events), (what, detail)
