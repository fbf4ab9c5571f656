"""Pick StarTrail's (C, placement) by measuring, as the paper's scheduler does (sec. 4.4).

Pure logic: the caller supplies ``run_trial(candidate)``, which runs a few
timed training iterations with that candidate and returns their times. The
Megatron entry point can call ``autotune`` for ``--startrail-team-size auto``::

    cands = startrail_candidates(cp_size)
    result = autotune(cands, lambda c: time_iterations(c, n=3), log=print_rank_0)
    team_size, placement = result.best.team_size, result.best.placement

In a distributed run every rank must get the *same* times back (e.g. reduce
them with MAX over the CP group inside ``run_trial``), or ranks could choose
differently and then deadlock.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .strategies import KINDS, Strategy

__all__ = ["AutotuneResult", "Trial", "autotune", "startrail_candidates"]


def startrail_candidates(cp_size: int) -> list[Strategy]:
    """Every valid StarTrail (C, placement) for ``cp_size``, C = 1 (ring) first."""
    return KINDS["startrail"].variants(cp_size)


@dataclass(frozen=True)
class Trial:
    candidate: Strategy
    times_s: tuple[float, ...]
    median_s: float | None
    """None when the trial failed."""
    error: str | None = None


@dataclass
class AutotuneResult:
    best: Strategy
    trials: list[Trial] = field(default_factory=list)
    """What was tried, in order, with the times or the error."""

    def summary(self) -> str:
        lines = []
        for t in self.trials:
            mark = "*" if t.candidate == self.best else " "
            what = f"{t.median_s * 1e3:.2f} ms" if t.median_s is not None else f"failed: {t.error}"
            lines.append(f"{mark} {t.candidate.name}: {what}")
        return "\n".join(lines)


def autotune(
    candidates: Sequence[Strategy],
    run_trial: Callable[[Strategy], Sequence[float] | float],
    *,
    log: Callable[[str], None] | None = None,
    catch: tuple[type[BaseException], ...] = (RuntimeError, MemoryError),
) -> AutotuneResult:
    """Run ``run_trial`` on each candidate and keep the fastest median time.

    A trial that raises one of ``catch`` (an out-of-memory error, say) is
    logged and skipped. Ties go to the earlier candidate. Raises
    ``ValueError`` for no candidates and ``RuntimeError`` when every trial
    failed.
    """
    if not candidates:
        raise ValueError("autotune needs at least one candidate (C, placement)")
    trials: list[Trial] = []
    for cand in candidates:
        try:
            raw = run_trial(cand)
        except catch as e:
            trial = Trial(cand, (), None, f"{type(e).__name__}: {e}")
        else:
            times = (float(raw),) if isinstance(raw, (int, float)) else tuple(float(t) for t in raw)
            if not times or any(t < 0 for t in times):
                raise ValueError(f"run_trial({cand.name}) returned {raw!r}: need times >= 0")
            trial = Trial(cand, times, statistics.median(times))
        trials.append(trial)
        if log is not None:
            what = (
                f"median {trial.median_s * 1e3:.2f} ms over {len(trial.times_s)} iterations"
                if trial.median_s is not None
                else f"failed ({trial.error})"
            )
            log(f"startrail autotune: {cand.name}: {what}")
    ok = [t for t in trials if t.median_s is not None]
    if not ok:
        raise RuntimeError(
            "startrail autotune: every candidate failed:\n"
            + "\n".join(f"  {t.candidate.name}: {t.error}" for t in trials)
        )
    best = min(ok, key=lambda t: t.median_s).candidate
    result = AutotuneResult(best, trials)
    if log is not None:
        log(f"startrail autotune: chose {best.name}")
    return result
