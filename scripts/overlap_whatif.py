"""The cost model on overlap choices: own rows first, and two tail designs not built.

    python scripts/overlap_whatif.py

Pure arithmetic (``planner.times.startrail_times``, the planner's H100 and A100 presets,
batch 1, head_dim 128). The figures of docs/performance.md section 11 are this output.

1. Own rows first (``CommOptions(own_rows_first=)``): attention time (forward +
   backward) with the split on against off, over P = 8 - 64, every valid C up to 8, both
   placements and five head shapes; and how often the default rule
   (``schedule.own_rows_first_pays``, with the team's nodes from the preset) picks the
   faster setting, and by how much it is behind where it does not.
2. What the last step's combine would gain from designs that are not built, priced by
   replacing the number of tail groups the model charges
   (``planner.times.tail_head_groups``): two row halves at G = 1 (where it is one group
   today), and four head groups instead of two at G > 1. Each group makes the step's
   calls again (``times.step_kernel_seconds`` charges them); the extra collectives' latency
   is not charged.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

from startrail_megatron.planner import CLUSTER_PRESETS
from startrail_megatron.planner import times as T
from startrail_megatron.planner.shape import AttnShape
from startrail_megatron.schedule.layout import StarTrailLayout, valid_team_sizes

CLUSTERS = ("h100-ib", "a100-eth")
HEADS = ((32, 32), (32, 8), (32, 4), (32, 1), (64, 8))
SIZES = ((8, 32768), (16, 32768), (32, 65536), (64, 131072))  # (P, tokens)


def attention_s(lay, cl, shape) -> float:
    return sum(T.startrail_times(lay, cl, shape, None))


def own_rows_first() -> None:
    print("1. own rows first: attention time with the split on vs off (fwd + bwd)")
    deltas, behind = [], []
    for name in CLUSTERS:
        base = CLUSTER_PRESETS[name]
        on, off = (dataclasses.replace(base, own_rows_first=x) for x in (True, False))
        for p, n in SIZES:
            for c in (c for c in valid_team_sizes(p) if 1 < c <= 8):
                for placement in ("team", "ring"):
                    lay = StarTrailLayout(p, c, placement)
                    row = []
                    for hq, hkv in HEADS:
                        shape = AttnShape(p, n // p, 1, hq, hkv, 128)
                        t_on, t_off, t_auto = (attention_s(lay, x, shape) for x in (on, off, base))
                        delta = (t_on - t_off) / t_off
                        deltas.append((delta, name, p, c, placement, hq, hkv))
                        behind.append((t_auto - min(t_on, t_off)) / min(t_on, t_off))
                        mark = "*" if t_auto == t_on and t_on != t_off else " "
                        row.append(f"{100 * delta:+5.1f}%{mark}")
                    print(f"  {name:9s} P={p:<3d} C={c} {placement:4s}  " + "  ".join(row))
    lo, hi = min(deltas), max(deltas)
    worse = [b for b in behind if b > 5e-4]
    print(f"  heads (q, kv): {HEADS}; *: the default rule turns it on")
    print(f"  on vs off: {100 * lo[0]:+.1f}% ({lo[1:]}) to {100 * hi[0]:+.1f}% ({hi[1:]})")
    print(
        f"  default rule: the faster setting in {len(behind) - len(worse)} of {len(behind)} "
        f"cases; at most {100 * max(worse, default=0.0):.1f}% behind in the others"
    )


def tail_whatif() -> None:
    print("2. the last step's combine, designs not built (gain in attention time)")
    real = T.tail_head_groups
    cases = (
        ("two row halves at G = 1", lambda lay, *a: (0, 1) if lay.ring_size == 1 else real(lay, *a),
         ((4, 2, 32768), (16, 4, 65536), (64, 8, 131072), (16, 4, 262144))),
        ("four head groups at G > 1", lambda lay, *a: (0, 1, 2, 3),
         ((8, 2, 32768), (32, 2, 65536), (32, 4, 65536), (64, 4, 131072))),
    )  # fmt: skip
    for label, groups, layouts in cases:
        gains = []
        for name in CLUSTERS:
            cl = CLUSTER_PRESETS[name]
            for p, c, n in layouts:
                for hq, hkv in ((32, 32), (32, 8)):
                    lay, shape = (
                        StarTrailLayout(p, c, "team"),
                        AttnShape(p, n // p, 1, hq, hkv, 128),
                    )
                    before = attention_s(lay, cl, shape)
                    with mock.patch.object(T, "tail_head_groups", groups):
                        after = attention_s(lay, cl, shape)
                    gains.append((before - after) / before)
        print(
            f"  {label}: {100 * min(gains):.2f}% to {100 * max(gains):.2f}% (P, C, tokens: {layouts})"
        )


if __name__ == "__main__":
    own_rows_first()
    tail_whatif()
