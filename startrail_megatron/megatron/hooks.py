"""The opt-in hooks that make megatron-core build StarTrail: ``install`` / ``uninstall``.

``install(team_size, placement)`` wraps ``parallel_state.initialize_model_parallel``
(all arguments passed through untouched) so that every caller, Megatron's own
included, gets the StarTrail groups (``registry.create_startrail_groups``; with
``hybrid_context_parallel=True`` also those of every hybrid sub-group,
``registry.create_hybrid_startrail_groups``) right after Megatron's, with the same ``distributed_timeout_minutes`` as
Megatron's groups; wraps ``destroy_model_parallel`` to release them first
(``registry.release_all_startrail_groups``: entries dropped, their
communicators destroyed); and wraps the model builders: the layer spec and
the multi-token-prediction block spec given to ``GPTModel``, and the hybrid
stack spec given to ``HybridModel`` (megatron-core 0.19; its MTP block spec
is inside it) are rewritten (``spec.apply_startrail_spec``), and the built
model is checked (``spec.check_startrail_model``: a layer that would mix
tokens other than through StarTrail on CP ranks is refused by name) and, with
``tiled_loss``, a ``GPTModel``'s logits and loss tiled (``tiled_loss.tile_lm_loss``).
``uninstall()`` restores every wrapped attribute; nothing is installed on
import.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from datetime import timedelta

import torch

from ..schedule import check_head_chunks_setting, check_own_rows_first, check_tile
from ..schedule.layout import PLACEMENT_SETTINGS, Placement, team_size_within
from .registry import (
    check_hybrid_team_sizes,
    create_hybrid_startrail_groups,
    create_startrail_groups,
    release_all_startrail_groups,
)
from .spec import apply_startrail_spec, check_startrail_model
from .tiled_loss import tile_lm_loss
from .tiled_mlp import tile_mlps
from .versions import cp_group_from

__all__ = ["install", "installed_config", "uninstall"]

_INSTALLED: dict[str, object] = {}


def installed_config() -> dict | None:
    """The (team_size, placement, kernel, own_rows_first, ulysses_size, tiled_loss,
    tiled_mlp, attention_tile, attention_head_chunks, placement_shape, hybrid_team_sizes) of
    ``install``, or None."""
    cfg = _INSTALLED.get("config")
    return dict(cfg) if cfg else None


def install(
    team_size: int,
    placement: Placement = "team",
    kernel: str = "auto",
    *,
    spec_hook: bool = True,
    own_rows_first: bool | None = None,
    ulysses_size: int = 1,
    tiled_loss: int | None = None,
    tiled_mlp: int | None = None,
    attention_tile: int | None = None,
    attention_head_chunks: int | None = None,
    placement_shape=None,
    hybrid_team_sizes: Mapping[int, int] | None = None,
) -> None:
    """Make Megatron create StarTrail groups and build StarTrail attention. Reversible.

    ``own_rows_first``: the groups' setting (``StarTrailGroups.own_rows_first``;
    ``--startrail-own-rows-first``): True, False, or None (auto). ``ulysses_size``: U of
    the 2-D split (``--startrail-ulysses-size``; 1: StarTrail over the whole CP group).
    ``tiled_loss``: every ``GPTModel`` built computes its logits and loss that many sequence
    positions at a time (``--startrail-tiled-loss``, ``tiled_loss.tile_lm_loss``); a
    ``HybridModel`` is refused with it; ``tiled_mlp`` likewise every layer's MLP
    (``--startrail-tiled-mlp``, ``tiled_mlp.tile_mlps``); ``attention_tile`` the
    attention's largest kernel call (``--startrail-attention-tile``,
    ``startrail_attention(tile=)``); ``attention_head_chunks`` the KV-head groups it runs one
    after the other (``--startrail-attention-head-chunks``, ``startrail_attention(head_chunks=)``).
    ``placement="auto"``: the map computed from the CP ranks' nodes when the groups are made
    (``registry.create_startrail_groups``), pricing ``placement_shape`` (a
    ``planner.shape.AttnShape``; ``arguments.placement_shape`` builds it from the flags).
    ``hybrid_team_sizes``: under hybrid CP, the team size of each sub-group size (and of the
    model's CP group's size) instead of the largest up to ``team_size`` that fits it (our
    entry point's ``--startrail-team-size auto``: the cost model's pick per size)."""
    from megatron.core import parallel_state

    if placement not in PLACEMENT_SETTINGS:
        raise ValueError(
            f"placement={placement!r} is not known; allowed: {list(PLACEMENT_SETTINGS)}"
        )
    if not isinstance(team_size, int) or team_size < 1:
        raise ValueError(f"team_size must be an integer >= 1, got {team_size!r}")
    if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size < 1:
        raise ValueError(f"ulysses_size must be an integer >= 1, got {ulysses_size!r}")
    check_own_rows_first(own_rows_first)
    check_tile(attention_tile, "--startrail-attention-tile")
    check_head_chunks_setting(attention_head_chunks)
    if hybrid_team_sizes is not None:
        check_hybrid_team_sizes(hybrid_team_sizes, sorted(hybrid_team_sizes))
        hybrid_team_sizes = dict(hybrid_team_sizes)
    uninstall()
    _INSTALLED["config"] = {
        "team_size": team_size,
        "placement": placement,
        "kernel": kernel,
        "own_rows_first": own_rows_first,
        "ulysses_size": ulysses_size,
        "tiled_loss": tiled_loss,
        "tiled_mlp": tiled_mlp,
        "attention_tile": attention_tile,
        "attention_head_chunks": attention_head_chunks,
        "placement_shape": placement_shape,
        "hybrid_team_sizes": hybrid_team_sizes,
    }
    orig_init = parallel_state.initialize_model_parallel
    orig_destroy = parallel_state.destroy_model_parallel
    init_sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def initialize_model_parallel(*args, **kwargs):
        out = orig_init(*args, **kwargs)
        cfg = _INSTALLED["config"]
        hybrid = _bound(init_sig, args, kwargs).get("hybrid_context_parallel")
        cp_group = parallel_state.get_context_parallel_group()
        c, placement, kernel = cfg["team_size"], cfg["placement"], cfg["kernel"]
        common = dict(
            timeout=_megatron_timeout(init_sig, args, kwargs),
            own_rows_first=cfg["own_rows_first"],
            ulysses_size=cfg["ulysses_size"],
            attention_tile=cfg["attention_tile"],
            attention_head_chunks=cfg["attention_head_chunks"],
        )
        # hybrid CP: the team size is each group's cap (the largest that fits it), or the
        # one given for its size
        per_size = cfg["hybrid_team_sizes"] if hybrid else None
        cp_c = c
        if hybrid:
            cp_size = torch.distributed.get_world_size(cp_group)
            cp_c = (per_size or {}).get(cp_size) or team_size_within(cp_size, c)
        create_startrail_groups(
            cp_group, cp_c, placement, kernel, placement_shape=cfg["placement_shape"], **common
        )
        if hybrid:
            create_hybrid_startrail_groups(c, placement, kernel, team_sizes=per_size, **common)
        return out

    @functools.wraps(orig_destroy)
    def destroy_model_parallel(*args, **kwargs):
        release_all_startrail_groups()
        return orig_destroy(*args, **kwargs)

    parallel_state.initialize_model_parallel = initialize_model_parallel
    parallel_state.destroy_model_parallel = destroy_model_parallel
    undo = [
        lambda: setattr(parallel_state, "initialize_model_parallel", orig_init),
        lambda: setattr(parallel_state, "destroy_model_parallel", orig_destroy),
    ]
    if spec_hook:
        from megatron.core.models.gpt import gpt_model

        # the decoder's layers and the multi-token-prediction (--mtp-num-layers) layers
        undo.append(
            _wrap_builder(
                gpt_model.GPTModel, ("transformer_layer_spec", "mtp_block_spec"), tiled=True
            )
        )
        try:
            from megatron.core.models.hybrid import hybrid_model
        except ImportError:  # megatron-core < 0.19: no HybridModel
            hybrid_model = None
        if hybrid_model is not None:
            undo.append(_wrap_builder(hybrid_model.HybridModel, ("hybrid_stack_spec",)))
    _INSTALLED["undo"] = undo


def _wrap_builder(cls: type, spec_args: tuple[str, ...], tiled: bool = False):
    """Wrap ``cls.__init__``: the named spec arguments rewritten for StarTrail, the built
    model checked, and with ``tiled`` its logits and loss tiled when the install asks for
    it (a class without ``tiled`` is refused then); returns the undo."""
    orig = cls.__init__
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def init(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        for name in spec_args:
            if bound.arguments.get(name) is not None:
                bound.arguments[name] = apply_startrail_spec(bound.arguments[name])
        cfg = _INSTALLED.get("config") or {}
        tokens, mlp_tokens = cfg.get("tiled_loss"), cfg.get("tiled_mlp")
        for flag, value in (("loss", tokens), ("mlp", mlp_tokens)):
            if value is not None and not tiled:
                raise ValueError(
                    f"--startrail-tiled-{flag} is not supported for {cls.__name__} yet "
                    "(GPTModel only)"
                )
        orig(*bound.args, **bound.kwargs)
        cp = cp_group_from(getattr(self, "pg_collection", None))
        check_startrail_model(self, torch.distributed.get_world_size(cp))
        if tokens is not None and getattr(self, "post_process", True):
            tile_lm_loss(self, tokens)  # a pipeline stage before the last has no output layer
        if mlp_tokens is not None:
            tile_mlps(self, mlp_tokens)

    cls.__init__ = init
    return lambda: setattr(cls, "__init__", orig)


def _bound(sig: inspect.Signature, args, kwargs) -> dict:
    """An ``initialize_model_parallel`` call's arguments by name, defaults included."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _megatron_timeout(sig: inspect.Signature, args, kwargs) -> timedelta | None:
    """The ``distributed_timeout_minutes`` of an ``initialize_model_parallel`` call (its
    default when not given), as Megatron uses it for its own groups."""
    if "distributed_timeout_minutes" not in sig.parameters:
        return None
    minutes = _bound(sig, args, kwargs)["distributed_timeout_minutes"]
    return timedelta(minutes=minutes) if minutes is not None else None


def uninstall() -> None:
    for fn in reversed(_INSTALLED.pop("undo", [])):
        fn()
    _INSTALLED.pop("config", None)
