"""StarTrail's groups for Megatron's context-parallel groups, and the opt-in hooks.

Megatron keeps its process groups in ``parallel_state``; StarTrail's team and
sub-ring groups are built from Megatron's CP group and kept here, keyed by
that CP group, so an attention module finds the groups for the CP group its
``pg_collection`` names. Two ways in:

* ``install(team_size, placement)``: wraps ``parallel_state.initialize_model_parallel``
  (all arguments passed through untouched) so that every caller, Megatron's
  own included, gets the StarTrail groups right after Megatron's, with the
  same ``distributed_timeout_minutes`` as Megatron's groups; wraps
  ``destroy_model_parallel`` to drop them; and rewrites the layer spec and the
  multi-token-prediction block spec given to ``GPTModel``
  (``spec.apply_startrail_spec``). ``uninstall()`` undoes it.
* ``create_startrail_groups(cp_group, team_size, placement)``: the explicit
  call, for runs that build their own process-group collection.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..comm import CommLedger
from ..groups import StarTrailGroups
from ..layout import Placement

__all__ = [
    "StarTrailMegatronState",
    "create_startrail_groups",
    "get_startrail_state",
    "install",
    "release_startrail_groups",
    "uninstall",
    "installed_config",
]


@dataclass
class StarTrailMegatronState:
    """What the attention modules of one CP group share."""

    groups: StarTrailGroups
    kernel: str = "auto"
    ledger: CommLedger = field(default_factory=CommLedger)


_STATES: dict[int, tuple[object, StarTrailMegatronState]] = {}
_INSTALLED: dict[str, object] = {}


def _key(cp_group) -> int:
    return id(cp_group if cp_group is not None else dist.GroupMember.WORLD)


def create_startrail_groups(
    cp_group,
    team_size: int,
    placement: Placement = "team",
    kernel: str = "auto",
    timeout: timedelta | None = None,
) -> StarTrailMegatronState:
    """Build and register StarTrail's groups for ``cp_group`` (collective over it).

    ``timeout``: of the new groups (default: the default process group's)."""
    groups = StarTrailGroups.create(
        team_size, cp_group=cp_group, placement=placement, timeout=timeout
    )
    state = StarTrailMegatronState(groups, kernel)
    _STATES[_key(cp_group)] = (cp_group, state)
    return state


def get_startrail_state(cp_group) -> StarTrailMegatronState:
    entry = _STATES.get(_key(cp_group))
    if entry is None:
        raise RuntimeError(
            "StarTrail attention found no StarTrail groups for its context-parallel group: "
            "run with --context-parallel-impl startrail (or call "
            "startrail_megatron.megatron.install(team_size=...) before "
            "parallel_state.initialize_model_parallel, or "
            "startrail_megatron.megatron.create_startrail_groups(cp_group, team_size))"
        )
    return entry[1]


def clear_startrail_groups() -> None:
    _STATES.clear()


def release_startrail_groups(cp_group) -> None:
    """Forget the StarTrail groups registered for ``cp_group`` and destroy their team and
    sub-ring groups (their communicators); collective over ``cp_group``. Nothing when
    none are registered."""
    entry = _STATES.pop(_key(cp_group), None)
    if entry is None:
        return
    groups = entry[1].groups
    for g in (groups.team_group, groups.subring_group):
        if g is not None:
            dist.destroy_process_group(g)


def installed_config() -> dict | None:
    """The (team_size, placement, kernel) of ``install``, or None."""
    cfg = _INSTALLED.get("config")
    return dict(cfg) if cfg else None


def install(
    team_size: int, placement: Placement = "team", kernel: str = "auto", *, spec_hook: bool = True
) -> None:
    """Make Megatron create StarTrail groups and build StarTrail attention. Reversible."""
    from megatron.core import parallel_state

    from ..layout import PLACEMENTS

    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not known; allowed: {list(PLACEMENTS)}")
    if not isinstance(team_size, int) or team_size < 1:
        raise ValueError(f"team_size must be an integer >= 1, got {team_size!r}")
    uninstall()
    _INSTALLED["config"] = {"team_size": team_size, "placement": placement, "kernel": kernel}
    orig_init = parallel_state.initialize_model_parallel
    orig_destroy = parallel_state.destroy_model_parallel
    init_sig = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def initialize_model_parallel(*args, **kwargs):
        out = orig_init(*args, **kwargs)
        cfg = _INSTALLED["config"]
        create_startrail_groups(
            parallel_state.get_context_parallel_group(),
            cfg["team_size"],
            cfg["placement"],
            cfg["kernel"],
            timeout=_megatron_timeout(init_sig, args, kwargs),
        )
        return out

    @functools.wraps(orig_destroy)
    def destroy_model_parallel(*args, **kwargs):
        clear_startrail_groups()
        return orig_destroy(*args, **kwargs)

    parallel_state.initialize_model_parallel = initialize_model_parallel
    parallel_state.destroy_model_parallel = destroy_model_parallel
    undo = [
        lambda: setattr(parallel_state, "initialize_model_parallel", orig_init),
        lambda: setattr(parallel_state, "destroy_model_parallel", orig_destroy),
    ]
    if spec_hook:
        from megatron.core.models.gpt import gpt_model

        from .spec import apply_startrail_spec

        orig_gpt_init = gpt_model.GPTModel.__init__

        gpt_sig = inspect.signature(orig_gpt_init)

        @functools.wraps(orig_gpt_init)
        def gpt_init(self, *args, **kwargs):
            bound = gpt_sig.bind(self, *args, **kwargs)
            # the decoder's layers and the multi-token-prediction (--mtp-num-layers) layers
            for name in ("transformer_layer_spec", "mtp_block_spec"):
                if bound.arguments.get(name) is not None:
                    bound.arguments[name] = apply_startrail_spec(bound.arguments[name])
            return orig_gpt_init(*bound.args, **bound.kwargs)

        gpt_model.GPTModel.__init__ = gpt_init
        undo.append(lambda: setattr(gpt_model.GPTModel, "__init__", orig_gpt_init))
    _INSTALLED["undo"] = undo


def _megatron_timeout(sig: inspect.Signature, args, kwargs) -> timedelta | None:
    """The ``distributed_timeout_minutes`` of an ``initialize_model_parallel`` call (its
    default when not given), as Megatron uses it for its own groups."""
    if "distributed_timeout_minutes" not in sig.parameters:
        return None
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    minutes = bound.arguments["distributed_timeout_minutes"]
    return timedelta(minutes=minutes) if minutes is not None else None


def uninstall() -> None:
    for fn in reversed(_INSTALLED.pop("undo", [])):
        fn()
    _INSTALLED.pop("config", None)
