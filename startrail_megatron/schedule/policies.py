"""Policies: how a rank runs a step, decided by pure rules that the attention and the
planner both call.

- ``tail_head_groups``: the head groups the last sub-ring step runs one after the other,
  so each group's team collectives overlap the next one's compute.
- ``splits_first_step``: whether the first computed step runs the rank's own query rows
  first (``own_rows.split_own_rows``), from the setting (``OWN_ROWS_FIRST_SETTINGS``)
  or, on auto, ``own_rows_first_pays``.

Pure arithmetic, no torch.
"""

from __future__ import annotations

from .layout import StarTrailLayout

__all__ = [
    "ALL_HEADS",
    "OWN_ROWS_FIRST_SETTINGS",
    "check_own_rows_first",
    "own_rows_first_pays",
    "splits_first_step",
    "tail_head_groups",
]


ALL_HEADS = ((slice(None), slice(None)),)
"""One (q heads, kv heads) group of every head: the steps before the last
(``tail_head_groups`` splits the last one)."""


def tail_head_groups(
    layout: StarTrailLayout, heads_q: int, heads_kv: int, dropout: bool
) -> tuple[tuple[slice, slice], ...]:
    """The (q heads, kv heads) groups the last sub-ring step runs one after the other, so
    the team collectives of one (the forward's lse and out, the backward's dq) overlap the
    next one's compute (``attention.py``'s Note [overlap]; the same calls, each on fewer
    heads).

    Two groups when there is a team combine (C > 1), a sub-ring (G > 1) and at least two
    query heads: the KV heads split in halves with their query heads (GQA groups stay
    whole), or with one KV head the query heads in halves. One group (all heads)
    otherwise. With dropout: a call's mask is drawn for all its heads, and the backward
    replays it whole. At G = 1 the one step is the whole computation: run by head groups,
    its head-sliced operands cost kernels that need contiguous inputs (the reference, TE)
    copies at the backward's peak, about 3 A at P = 4, C = 2 (``tests/test_memory.py``),
    more than hiding half the combine is worth; the last step of G > 1 holds no next K,V,
    which leaves room for them."""
    every = ((slice(0, heads_q), slice(0, heads_kv)),)
    if layout.team_size == 1 or layout.ring_size == 1 or heads_q < 2 or dropout:
        return every
    if heads_kv >= 2:
        per, k1 = heads_q // heads_kv, heads_kv // 2
        return ((slice(0, k1 * per), slice(0, k1)), (slice(k1 * per, heads_q), slice(k1, heads_kv)))
    h1 = heads_q // 2
    return ((slice(0, h1), slice(0, 1)), (slice(h1, heads_q), slice(0, 1)))


OWN_ROWS_FIRST_SETTINGS = {"auto": None, "on": True, "off": False}
"""The words of every own-rows-first setting (Megatron's ``--startrail-own-rows-first``,
DeepSpeed's ``startrail.own_rows_first``, ``$STARTRAIL_OWN_ROWS_FIRST``, the tools'
``--own-rows-first``) -> ``CommOptions(own_rows_first=)``; ``None``: this rule."""


def check_own_rows_first(value, name: str = "own_rows_first") -> bool | None:
    """``value`` when it is True, False or None (auto); else ``ValueError`` naming ``name``."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True, False or None (auto)")
    return value


def own_rows_first_pays(
    layout: StarTrailLayout, heads_q: int, heads_kv: int, team_hosts: int
) -> bool:
    """Whether StarTrail's first step runs its own rows first by default
    (``comm.CommOptions(own_rows_first=None)``); ``team_hosts``: how many hosts the
    rank's team spans (``StarTrailGroups.team_hosts``).

    The team gather (forward: the other members' q, (C-1) local q's; backward: dout and
    delta alike) and the initial placement (C local K,V's received) start together. The
    split hides the gather behind the own rows' calls, so it pays only where the gather
    would still be in flight when the placement has arrived; it costs a few more calls
    everywhere. A team inside one host gathers over the fast links while the placement
    crosses hosts: the gather ends first. A team across hosts gathers over the same kind
    of link as the placement, so it ends later when it carries more bytes: (C-1) *
    heads_q > 2 * C * heads_kv (GQA with few K,V heads). This is the planner's verdict on
    its presets (``startrail-plan --own-rows-first on|off`` prices either; section 11 of
    ``docs/performance.md``)."""
    c = layout.team_size
    if c == 1 or team_hosts < 2:
        return False
    return (c - 1) * heads_q > 2 * c * heads_kv


def splits_first_step(
    layout: StarTrailLayout,
    *,
    packed: bool,
    dropout: bool,
    setting: bool | None,
    heads_q: int,
    heads_kv: int,
    team_hosts: int,
) -> bool:
    """Whether the first computed step runs its own rows' calls first: only with a team
    gather to hide (C > 1), dense rows (``packed`` documents map rows per document) and
    no ``dropout`` (its records are keyed by call); then the ``setting`` (True / False),
    or where it is None (auto), ``own_rows_first_pays``."""
    if layout.team_size == 1 or packed or dropout:
        return False
    if setting is None:
        return own_rows_first_pays(layout, heads_q, heads_kv, team_hosts)
    return setting
