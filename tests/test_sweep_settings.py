"""A seeded random sweep over the adapters' settings: Megatron's flags (through our parser
and ``validate_startrail_args`` as upstream Megatron-LM calls it) and DeepSpeed's
``"startrail"`` section (``StarTrailConfig`` and its world-size check). An oracle written
here from the documented rules says which settings are valid; every setting is either
accepted (and then the core's layout for it builds: what ran exact in
``test_sweep_ranks.py``) or a ``ValueError`` naming one of the settings the oracle found
wrong. A valid setting refused, an invalid one accepted, or an error naming none of the
wrong settings fails.
"""

from __future__ import annotations

import argparse
import random

from startrail_megatron.deepspeed.config import StarTrailConfig
from startrail_megatron.megatron.arguments import add_startrail_args, validate_startrail_args
from startrail_megatron.schedule.layout import valid_team_sizes
from startrail_megatron.schedule.ulysses import UlyssesLayout

CASES = 400


def _divides(a: int, b: int) -> bool:
    return b % a == 0


def _megatron_case(rng: random.Random) -> tuple[list[str], dict, set[str]]:
    """(our flags, Megatron's own settings, the flags the oracle finds wrong)."""
    p = rng.choice([1, 2, 3, 4, 6, 8, 9, 12, 16])
    u = rng.choice([d for d in (1, 2, 4) if _divides(d, p)]) if rng.random() < 0.8 else 3
    if rng.random() < 0.6 and _divides(u, p):
        c = str(rng.choice(valid_team_sizes(p // u)))
    else:
        c = rng.choice(["1", "2", "3", "4", "auto"])
    heads = rng.choice([2, 4, 6, 8])
    gqa = rng.random() < 0.5
    groups = rng.choice([d for d in (1, 2, 3, 4, 6, 8) if heads % d == 0]) if gqa else heads
    seq = 2 * p * rng.randint(1, 4) + (1 if rng.random() < 0.1 else 0)
    drop = rng.choice([0.0, 0.0, 0.0, 0.1])
    chunks = rng.choice([None, None, 1, 2, 3, 4])
    placement = rng.choice(["team", "ring", "auto"])
    flags = [
        "--context-parallel-impl", "startrail", "--startrail-team-size", c,
        "--startrail-ulysses-size", str(u), "--startrail-placement", placement,
    ]  # fmt: skip
    if chunks is not None:
        flags += ["--startrail-attention-head-chunks", str(chunks)]
    mega = dict(
        context_parallel_size=p, num_attention_heads=heads, group_query_attention=gqa,
        num_query_groups=groups, seq_length=seq, attention_dropout=drop,
    )  # fmt: skip
    wrong: set[str] = set()
    if not _divides(u, p):
        wrong.add("--startrail-ulysses-size")
    elif u > 1:
        if c == "auto":
            wrong.add("--startrail-team-size")
        if not (_divides(u, heads) and (_divides(u, groups) or _divides(groups, u))):
            wrong.add("--startrail-ulysses-size")
        if drop:
            wrong.add("--attention-dropout")
    ring = p // u if _divides(u, p) else p
    if c == "auto" or not _divides(int(c) ** 2, ring):
        wrong.add("--startrail-team-size")  # 'auto': our entry point only
    if c == "auto" and placement == "auto":
        wrong.add("--startrail-placement")
    if seq % (2 * p):
        wrong.add("--seq-length")
    if chunks is not None:
        ring_kv = max(groups, u) // u if u > 1 and _divides(u, p) else groups
        if not _divides(chunks, ring_kv) or (chunks > 1 and drop):
            wrong.add("--startrail-attention-head-chunks")
    return flags, mega, wrong


def test_megatron_flags_are_accepted_or_refused_naming_the_wrong_one():
    rng = random.Random(20261205)
    parser = add_startrail_args(argparse.ArgumentParser())
    counts = {"accepted": 0, "refused": 0}
    for i in range(CASES):
        flags, mega, wrong = _megatron_case(rng)
        args = parser.parse_args(flags)
        vars(args).update(mega)
        try:
            validate_startrail_args(args, allow_auto=False)
        except ValueError as e:
            counts["refused"] += 1
            assert wrong, (i, flags, mega, f"a valid setting refused: {e}")
            assert any(w in str(e) for w in wrong), (i, flags, mega, wrong, str(e))
            continue
        counts["accepted"] += 1
        assert not wrong, (i, flags, mega, f"accepted though {wrong} are wrong")
        u, c = args.startrail_ulysses_size, args.startrail_team_size
        named = "team" if args.startrail_placement == "auto" else args.startrail_placement
        UlyssesLayout(mega["context_parallel_size"], u, c, named)
    assert min(counts.values()) >= CASES // 5, counts
    print(f"megatron flags: {counts}")


def _deepspeed_case(rng: random.Random) -> tuple[dict, int, set[str]]:
    """(the section, the world size, the keys the oracle finds wrong)."""
    p = rng.choice([1, 2, 4, 6, 8, 9, 16, 16, 8]) if rng.random() < 0.9 else rng.choice(["4", 0])
    u = rng.choice([1, 1, 1, 2, 4, 3])
    if rng.random() < 0.6 and isinstance(p, int) and p > 0 and _divides(u, p):
        c = rng.choice(valid_team_sizes(p // u))
    else:
        c = rng.choice([1, 2, 3, 4, True, 2.0, -1])
    bad = rng.random() < 0.3  # one key drawn from its wrong values
    placement = rng.choice(["team", "ring", "auto"] if not bad else ["team", "ring", "rings"])
    zm = rng.choice(["none"] * 4 + ["hpz_team"] + (["hpz"] if bad else []))
    tile = rng.choice([None, None, 4] + ([0, "8"] if bad else []))
    section = dict(
        enabled=True, sequence_parallel_size=p, team_size=c, ulysses_size=u,
        placement=placement, zero_mapping=zm,
    )  # fmt: skip
    if tile is not None:
        section["attention_tile"] = tile
    world = rng.choice([16, 48, 144]) if rng.random() < 0.9 else 12
    wrong: set[str] = set()
    int_ok = {k: isinstance(v, int) and not isinstance(v, bool) for k, v in section.items()}
    if not int_ok["sequence_parallel_size"] or p < 1:
        wrong.add("sequence_parallel_size")
    if not int_ok["team_size"] or c < 1:
        wrong.add("team_size")
    if placement not in ("team", "ring", "auto"):
        wrong.add("placement")
    if zm not in ("none", "hpz_team"):
        wrong.add("zero_mapping")
    if tile is not None and (not int_ok["attention_tile"] or tile < 1):
        wrong.add("attention_tile")
    if not wrong:  # the cross-field checks run once every field is valid
        if not _divides(u, p):
            wrong.add("ulysses_size")
        elif not _divides(c * c, p // u):
            wrong |= {"team_size"} if u == 1 else {"team_size", "ulysses_size"}
        if zm == "hpz_team" and (c == 1 or u > 1):
            wrong.add("zero_mapping")
        if not wrong and world % p:
            wrong.add("sequence_parallel_size")
    return section, world, wrong


def test_deepspeed_sections_are_accepted_or_refused_naming_the_wrong_key():
    rng = random.Random(20261206)
    counts = {"accepted": 0, "refused": 0}
    for i in range(CASES):
        section, world, wrong = _deepspeed_case(rng)
        try:
            cfg = StarTrailConfig.from_ds_config({"startrail": section})
            cfg.check_world(world)
        except ValueError as e:
            counts["refused"] += 1
            assert wrong, (i, section, world, f"a valid setting refused: {e}")
            assert any(f"startrail.{w}" in str(e) for w in wrong), (i, section, wrong, str(e))
            continue
        counts["accepted"] += 1
        assert not wrong, (i, section, world, f"accepted though {wrong} are wrong")
        named = "team" if cfg.placement == "auto" else cfg.placement
        UlyssesLayout(cfg.sequence_parallel_size, cfg.ulysses_size, cfg.team_size, named)
    assert min(counts.values()) >= CASES // 5, counts
    print(f"deepspeed sections: {counts}")
