"""Draw StarTrail's teams and sub-rings for P = 8 CP ranks and team size C = 2.

    python scripts/algorithm_figure.py [--out docs/algorithm_layout.png]

One row per placement (``"team"``, ``"ring"``). The eight CP ranks sit in two nodes of
four ranks. A box's colour is its team; an arrow goes from each rank to the next rank of
its sub-ring (``StarTrailLayout.ring_next``). Under each row: how many sub-ring hops,
team links (ordered pairs of team members) and initial K,V placement messages
(``StarTrailLayout.placement_targets``) go between nodes. Everything drawn is read from
``StarTrailLayout``, nothing is typed in. The picture in docs/algorithm.md is this
script's output.
"""

from __future__ import annotations

import argparse

from startrail_megatron.schedule.layout import PLACEMENTS, StarTrailLayout

P, C, NODE = 8, 2, 4
TEAM_COLOURS = ["#8ecae6", "#ffb703", "#a7c957", "#f4a3c0"]
RING_COLOURS = ["#1d3557", "#9d0208", "#2d6a4f", "#6a4c93"]
CAPTIONS = {
    "team": 'placement "team": team members are adjacent ranks',
    "ring": 'placement "ring": sub-ring neighbours are adjacent ranks',
}


def x_of(rank: int) -> float:
    """Left edge of a rank's box: one unit per rank, a gap between nodes."""
    return rank * 1.3 + (rank // NODE) * 0.8


def node_summary(lay: StarTrailLayout) -> str:
    """Which of this layout's transfers cross nodes, counted from the layout."""

    def crossing(pairs: list[tuple[int, int]]) -> int:
        return sum(src // NODE != dst // NODE for src, dst in pairs)

    ring = [(r, lay.ring_next(r)) for r in range(P) if lay.ring_next(r) != r]
    team = [(x, y) for ts in lay.all_team_ranks() for x in ts for y in ts if x != y]
    place = [(r, d) for r in range(P) for d in lay.placement_targets(r) if d != r]
    return (
        f"between nodes: sub-ring hops {crossing(ring)} of {len(ring)}, team links "
        f"{crossing(team)} of {len(team)}, initial K,V placement {crossing(place)} of "
        f"{len(place)} messages"
    )


def draw_row(ax, lay: StarTrailLayout, y: float) -> None:
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    w, h = 1.1, 0.62
    for node in range(P // NODE):
        lo, hi = x_of(node * NODE) - 0.2, x_of(node * NODE + NODE - 1) + w + 0.2
        ax.add_patch(
            FancyBboxPatch(
                (lo, y - 0.62), hi - lo, h + 1.24, boxstyle="round,pad=0.02",
                facecolor="#f4f4f4", edgecolor="#888888", linestyle="--", zorder=0,
            )
        )  # fmt: skip
        ax.text(lo + 0.08, y + h + 0.48, f"node {node}", fontsize=9, color="#555555")
    for r in range(P):
        t, a = lay.coord(r)
        ax.add_patch(
            FancyBboxPatch(
                (x_of(r), y), w, h, boxstyle="round,pad=0.02",
                facecolor=TEAM_COLOURS[t], edgecolor="black", zorder=2,
            )
        )  # fmt: skip
        ax.text(x_of(r) + w / 2, y + 0.40, f"rank {r}", ha="center", fontsize=9.5, zorder=3)
        ax.text(x_of(r) + w / 2, y + 0.13, f"t={t}, a={a}", ha="center", fontsize=8, zorder=3)
    for r in range(P):
        nxt = lay.ring_next(r)
        if nxt == r:
            continue
        colour = RING_COLOURS[lay.subring_index(r)]
        # Arrows that go right arc over the boxes, those that go left under them.
        right = nxt > r
        yy = y + h + 0.02 if right else y - 0.02
        ax.add_patch(
            FancyArrowPatch(
                (x_of(r) + w / 2, yy), (x_of(nxt) + w / 2, yy),
                connectionstyle="arc3,rad=-0.35",
                arrowstyle="-|>", mutation_scale=12, color=colour, linewidth=1.6, zorder=1,
            )
        )  # fmt: skip
    teams = "  ".join("{" + ",".join(map(str, ts)) + "}" for ts in lay.all_team_ranks())
    rings = "  ".join("{" + ",".join(map(str, rs)) + "}" for rs in lay.all_subring_ranks())
    ax.text(x_of(0) - 0.2, y + h + 0.98, CAPTIONS[lay.placement], fontsize=10.5, weight="bold")
    ax.text(x_of(P - 1) + w + 0.45, y + 0.5, f"teams:\n{teams}", fontsize=9, va="center")
    ax.text(x_of(P - 1) + w + 0.45, y - 0.25, f"sub-rings:\n{rings}", fontsize=9, va="center")
    ax.text(x_of(0) - 0.2, y - 0.95, node_summary(lay), fontsize=8.5, color="#444444")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/algorithm_layout.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.1, 4.1))
    for i, placement in enumerate(PLACEMENTS):
        draw_row(ax, StarTrailLayout(P, C, placement), y=2.9 * (len(PLACEMENTS) - 1 - i))
    ax.set_xlim(-0.4, x_of(P - 1) + 3.6)
    ax.set_ylim(-1.1, 2.9 * len(PLACEMENTS) - 0.8)
    ax.set_aspect("equal")
    ax.set_anchor("N")
    ax.axis("off")
    fig.suptitle(
        f"StarTrail, P = {P}, C = {C}: colour = team, arrow = next rank on the sub-ring",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
