"""The ``"startrail"`` section of a DeepSpeed JSON config.

DeepSpeed ignores top-level keys it does not know, so a config with this
section is still a valid plain DeepSpeed config::

    "startrail": {
        "enabled": true,
        "sequence_parallel_size": 4,
        "team_size": 2,
        "placement": "team",
        "zero_mapping": "none",
        "own_rows_first": "auto",
        "ulysses_size": 1,
        "tiled_mlp": null,
        "tiled_loss": null,
        "attention_tile": null,
        "attention_head_chunks": null,
        "hybrid_context_parallel": false,
        "batch_cluster": "h100-ib",
        "max_tokens_per_rank": null
    }

The model follows DeepSpeed's own config models (``DeepSpeedConfigModel``:
unknown keys rejected, assignments validated). Every error is a
``ValueError`` whose message names the key as ``startrail.<key>`` and the
allowed values. Checks that need the world size are in
``StarTrailConfig.check_world``.
"""

from __future__ import annotations

from typing import Any, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, ValidationError, model_validator

from ..schedule import OWN_ROWS_FIRST_SETTINGS
from ..schedule.layout import PLACEMENT_SETTINGS, divisors, valid_team_sizes
from ..schedule.ulysses import UlyssesLayout

__all__ = ["STARTRAIL_KEY", "ZERO_MAPPINGS", "StarTrailConfig"]

STARTRAIL_KEY = "startrail"
ZERO_MAPPINGS: tuple[str, ...] = ("none", "hpz_team")


class StarTrailConfig(DeepSpeedConfigModel):
    """StarTrail sequence parallelism inside DeepSpeed."""

    enabled: bool = Field(False, strict=True)
    """Turn StarTrail on. ``false`` (or no section) leaves DeepSpeed exactly as it is."""

    sequence_parallel_size: int = Field(1, ge=1, strict=True)
    """P: ranks sharing one sequence (StarTrail's context-parallel group). It must
    divide the world size; world / P ranks are data parallel."""

    team_size: int = Field(1, ge=1, strict=True)
    """C: StarTrail's team size; C*C must divide P. 1 is zigzag ring attention."""

    placement: Literal["team", "ring", "auto"] = "team"
    """``"team"``: team members on adjacent ranks (team collectives inside a node);
    ``"ring"``: sub-ring neighbours on adjacent ranks (ring P2P inside a node);
    ``"auto"``: the map of teams and sub-rings onto the ranks that the planner's cost
    model predicts fastest on the nodes the ranks run on (found by hostname;
    ``auto_placement``), for its default attention call (``planner.placement.AUTO_SHAPE``:
    the section does not know the model's)."""

    zero_mapping: Literal["none", "hpz_team"] = "none"
    """``"none"``: ZeRO partitions over sequence x data parallel ranks.
    ``"hpz_team"``: ZeRO-3's hierarchical partition (ZeRO++ hpZ,
    ``zero_hpz_partition_size`` = C) is the StarTrail team, so the secondary
    parameter all-gather stays inside a team. Needs ZeRO stage 3 and
    team_size > 1. With ``placement: "team"`` DeepSpeed's own contiguous hpZ
    groups are the teams; with ``"ring"`` the team groups are handed to it."""

    own_rows_first: Literal["auto", "on", "off"] = "auto"
    """The first sub-ring step runs this rank's own query rows while the team gathers
    q (forward) and dout (backward): ``"on"``, ``"off"``, or ``"auto"``:
    ``$STARTRAIL_OWN_ROWS_FIRST`` where set, else on only where the team spans hosts and
    the gather outweighs the K,V placement (docs/performance.md, section 11)."""

    ulysses_size: int = Field(1, ge=1, strict=True)
    """U of the 2-D split (``schedule/ulysses.py``'s Note [the 2-D split]): all-to-all of
    heads over U consecutive sequence-parallel ranks, StarTrail (``team_size``) over the
    P / U ranks holding the same heads. U divides P and the attention heads; 1 (default):
    StarTrail over all P ranks. No attention dropout and no ``hpz_team`` with U > 1 yet."""

    tiled_mlp: int | None = Field(None, ge=1, strict=True)
    """Tokens per shard of every decoder layer's MLP (transformers models): DeepSpeed's own
    ``TiledMLP`` runs the MLP a sequence shard at a time and recomputes each shard in the
    backward, so its intermediates exist for one shard (``deepspeed/tiled_mlp.py``).
    None (default): untiled. Not for the Megatron GPT and DiT paths, nor MoE blocks."""

    attention_tile: int | None = Field(None, ge=1, strict=True)
    """StarTrail's kernel calls cut to at most this many query rows by as many key rows
    (``startrail_attention(tile=)``, ``schedule.tile_calls``; transformers models): a call's
    backward gradients are then bounded by the tile, not by C x the local tokens. The same
    result, more calls. None (default): whole calls. Not for the Megatron GPT
    (``--startrail-attention-tile``) and DiT paths."""

    attention_head_chunks: int | None = Field(None, ge=1, strict=True)
    """StarTrail's attention on this many groups of KV heads one after the other
    (``startrail_attention(head_chunks=)``; transformers models): its team-sized buffers
    hold one group's heads at a time. Must divide the model's KV heads (checked at the
    first call, naming ``head_chunks``); not with attention dropout. The same result, more
    messages of the same bytes. None (default): all heads at once. Not for the Megatron GPT
    (``--startrail-attention-head-chunks``) and DiT paths."""

    tiled_loss: int | None = Field(None, ge=1, strict=True)
    """Tokens per shard of the output layer and the loss (transformers causal LMs): the
    ``[tokens, vocab]`` logits exist for one shard, through DeepSpeed's own
    ``sequence_tiled_compute`` (recomputed in the backward; ``deepspeed/tiled_loss.py``).
    ``output.logits`` is then never made (reading it raises). None (default): untiled. Not
    for the Megatron GPT (``--startrail-tiled-loss``) and DiT paths, nor models that scale or
    soft-cap their logits before the loss."""

    hybrid_context_parallel: bool = Field(False, strict=True)
    """Per-batch CP layouts (``schedule/batch.py``'s Note [per-batch CP layouts];
    transformers models): each document of a packed row on an aligned sub-group of the
    sequence-parallel ranks of its own size, one rank alone where it is short, with the
    largest team size up to ``team_size`` that fits the sub-group, placed batch by batch by
    our scheduler (``planner.batch.schedule_batch``, priced on ``batch_cluster`` for the
    model's layer; ``deepspeed/hybrid.py``). Megatron's ``--hybrid-context-parallel``, over
    the P ranks of a replica. One row per batch; ``placement: "team"`` and
    ``ulysses_size: 1``. False (default): every batch on all P ranks."""

    batch_cluster: str = "h100-ib"
    """With ``hybrid_context_parallel``: the cluster the scheduler prices layouts on, a
    preset of ``startrail-plan --cluster`` (its nodes holding min(P, 8) ranks) or a cluster
    JSON file (``startrail-plan --cluster-json``)."""

    max_tokens_per_rank: int | None = Field(None, ge=2, strict=True)
    """With ``hybrid_context_parallel``: the most tokens a rank may hold in a batch (its
    sub-group's documents packed and sharded, padding included); the scheduler keeps every
    layout within it (memory). None (default): no cap."""

    @model_validator(mode="after")
    def _check(self) -> StarTrailConfig:
        p, c, u = self.sequence_parallel_size, self.team_size, self.ulysses_size
        if self.hybrid_context_parallel:
            if u > 1 or self.placement != "team":
                raise ValueError(
                    "startrail.hybrid_context_parallel runs each sub-group with the team "
                    f"placement and without the 2-D split; got startrail.placement="
                    f"{self.placement!r}, startrail.ulysses_size={u}; allowed: 'team' and 1"
                )
            batch_cluster(self.batch_cluster)  # ValueError naming the key
        else:
            for key, default in (("batch_cluster", "h100-ib"), ("max_tokens_per_rank", None)):
                if getattr(self, key) != default:
                    raise ValueError(
                        f"startrail.{key} applies with startrail.hybrid_context_parallel=true "
                        "only; set that or drop the key"
                    )
        if u > 1:
            try:
                UlyssesLayout(p, u, c, "team" if self.placement == "auto" else self.placement)
            except ValueError as e:
                raise ValueError(
                    f"startrail.ulysses_size={u} with startrail.sequence_parallel_size={p} and "
                    f"startrail.team_size={c}: {e}"
                ) from None
            if self.zero_mapping == "hpz_team":
                raise ValueError(
                    "startrail.zero_mapping='hpz_team' is not supported with "
                    f"startrail.ulysses_size={u} > 1 yet (the teams are not contiguous ranks); "
                    "allowed: 'none'"
                )
        elif p % (c * c) != 0:
            raise ValueError(
                f"startrail.team_size={c} does not fit startrail.sequence_parallel_size={p}: "
                f"team_size**2 must divide it; allowed team_size values: {valid_team_sizes(p)}"
            )
        if self.zero_mapping == "hpz_team":
            if c == 1:
                raise ValueError(
                    "startrail.zero_mapping='hpz_team' needs startrail.team_size > 1 (a team of "
                    "one rank is no hierarchical partition); allowed with team_size=1: 'none'"
                )
        return self

    @classmethod
    def from_ds_config(cls, ds_config: dict[str, Any]) -> StarTrailConfig:
        """Validate ``ds_config["startrail"]`` (absent: disabled). ``ValueError`` names the key."""
        section = ds_config.get(STARTRAIL_KEY, {})
        if not isinstance(section, dict):
            raise ValueError(f"{STARTRAIL_KEY} must be a JSON object, got {type(section).__name__}")
        try:
            # strict=True: DeepSpeed's lenient mode silently drops "auto" values.
            return cls(strict=True, **section)
        except ValidationError as e:
            raise ValueError(_describe(e)) from None

    def check_world(self, world_size: int) -> None:
        """Checks that need the world size (``ValueError`` naming the key)."""
        p = self.sequence_parallel_size
        if world_size % p != 0:
            allowed = divisors(world_size)
            raise ValueError(
                f"startrail.sequence_parallel_size={p} does not divide the world size "
                f"{world_size}; allowed: {allowed}"
            )

    @property
    def own_rows_first_value(self) -> bool | None:
        """``own_rows_first`` as ``StarTrailGroups.own_rows_first``: None, True, False."""
        return OWN_ROWS_FIRST_SETTINGS[self.own_rows_first]

    @property
    def active(self) -> bool:
        """StarTrail changes something: enabled with P > 1."""
        return self.enabled and self.sequence_parallel_size > 1


_FIELD_HINTS = {
    "enabled": "true or false",
    "sequence_parallel_size": "an integer >= 1",
    "team_size": "an integer >= 1 with team_size**2 dividing sequence_parallel_size",
    "placement": f"one of {list(PLACEMENT_SETTINGS)}",
    "zero_mapping": f"one of {list(ZERO_MAPPINGS)}",
    "own_rows_first": f"one of {list(OWN_ROWS_FIRST_SETTINGS)}",
    "ulysses_size": "an integer >= 1 dividing sequence_parallel_size",
    "tiled_mlp": "an integer >= 1 or null",
    "attention_tile": "an integer >= 1 or null",
    "attention_head_chunks": "an integer >= 1 or null",
    "tiled_loss": "an integer >= 1 or null",
    "hybrid_context_parallel": "true or false",
    "batch_cluster": "a preset of startrail-plan --cluster or a cluster JSON file",
    "max_tokens_per_rank": "an integer >= 2 or null",
}


_NOT_YET = {
    "dynamic_context_parallel": (
        "Megatron-LM's dev-branch name of hybrid context parallelism; set "
        "startrail.hybrid_context_parallel=true"
    )
}
"""Keys users of Megatron's per-batch CP may try, refused with the reason."""


def batch_cluster(name: str, ranks: int | None = None):
    """The ``ClusterSpec`` of ``startrail.batch_cluster`` (a preset, with ``ranks`` its nodes
    holding min(ranks, 8) of them, or a cluster JSON file); ``ValueError`` naming the key."""
    from ..planner.cli import named_cluster

    return named_cluster(name, f"startrail.batch_cluster={name!r}", ranks)


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        key = f"{STARTRAIL_KEY}.{loc}" if loc else STARTRAIL_KEY
        if e["type"] == "extra_forbidden" and loc in _NOT_YET:
            lines.append(f"{key} is not supported on the DeepSpeed path: {_NOT_YET[loc]}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{key} is not a known key; allowed keys: {list(_FIELD_HINTS)}")
        elif e["type"] == "value_error":
            lines.append(str(e["ctx"]["error"]))
        else:
            hint = _FIELD_HINTS.get(loc, "")
            lines.append(
                f"{key}={e.get('input')!r}: {e['msg']}" + (f"; allowed: {hint}" if hint else "")
            )
    return "invalid DeepSpeed config section: " + "; ".join(lines)
