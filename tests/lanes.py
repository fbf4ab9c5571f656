"""The test lanes' selections (``pytest --lane``; CI's two lanes in ``.ci/run``).

``all`` (the default; ``scripts/run_tests.sh``, the README's test command): every test.
``stack``: the test files whose code paths import megatron-core, DeepSpeed or transformers
(``scripts/run_tests_py312.sh`` runs this lane by default: the adapters on Python 3.12).

CI (``.ci/run``) runs two lanes side by side, one pytest process each: ``ci-1`` on Python 3.11 with megatron-core 0.16.1 and ``ci-2`` on
Python 3.12 with megatron-core 0.19.2. The two pin the
same torch, DeepSpeed and transformers releases (on our CI machines torch's CPU build on
3.11, its CUDA build, the only one for 3.12, there): megatron-core is the one dependency whose release differs.
So the test files whose code paths reach megatron-core (``MEGATRON_TEST_FILES``) run on both
lanes, and every other test file runs once: on ``ci-2`` if it is in ``CI_LANE_2_FILES``,
else on ``ci-1``. ``test_imports.py`` checks
that every test file reaching megatron-core (importing it, our Megatron adapter or its test
helpers, or a test module that does) is in ``MEGATRON_TEST_FILES`` (a new adapter test
cannot miss a release), that every stack-importing file is in ``STACK_TEST_FILES``, and that
every file runs in CI.
"""

from __future__ import annotations

from fnmatch import fnmatch

__all__ = [
    "CI_LANE_2_FILES",
    "HALVES",
    "LANES",
    "MEGATRON_TEST_FILES",
    "SECOND_HALF_FILES",
    "STACK_TEST_FILES",
    "in_half",
    "in_lane",
    "in_megatron_lanes",
    "in_stack_lane",
]

LANES = ("all", "stack", "ci-1", "ci-2")

STACK_TEST_FILES = (
    "test_megatron*.py",
    "test_deepspeed*.py",
    "test_dit.py",
    "test_faults.py",
    "test_imports.py",
    "test_sweep_settings.py",
)
"""Test files (globs on the file name) that the ``stack`` lane runs."""

MEGATRON_TEST_FILES = (
    "test_megatron*.py",
    "test_deepspeed_megatron.py",
    "test_imports.py",
    "test_sweep_settings.py",
)
"""Test files (globs) whose code paths reach megatron-core: CI runs them on both releases."""

CI_LANE_2_FILES = (
    "test_attention.py",
    "test_comm.py",
    "test_deepspeed.py",
    "test_deepspeed_dit.py",
    "test_faults.py",
    "test_misuse.py",
    "test_spawn.py",
)
"""Test files that reach no megatron-core, run once in CI on its Python 3.12 lane instead of
its Python 3.11 one. Chosen so that the lanes end about together (a fresh-clone ``.ci/run`` with
``--durations``: lane 1's tests took 483 s and lane 2's 456 s with the first five of these;
test_gpu_check.py, ~14 s, moved after; on 2026-12-05 lane 1 took 450 - 494 s and lane 2
355 - 396 s before test_faults.py, ~60 s on Python 3.11, moved; on 2026-12-05 evening lane 1
took 418 s and lane 2 456 s, and test_gpu_check.py went back to lane 1; then 434 s and
464 s, and test_window.py, ~19 s, went back too; on 2026-12-06 lane 1 took 540 s and lane 2
482 s, and test_misuse.py and test_spawn.py, ~28 s of which most is waiting for timeouts,
moved)."""


def in_stack_lane(filename: str) -> bool:
    return any(fnmatch(filename, pat) for pat in STACK_TEST_FILES)


def in_megatron_lanes(filename: str) -> bool:
    """Whether CI runs ``filename`` on both lanes (both megatron-core releases)."""
    return any(fnmatch(filename, pat) for pat in MEGATRON_TEST_FILES)


HALVES = (0, 1, 2)

SECOND_HALF_FILES = (
    "test_auto_placement.py",
    "test_backends.py",
    "test_bench.py",
    "test_bytecode_cache.py",
    "test_comm.py",
    "test_deepspeed_checkpoints.py",
    "test_deepspeed_models.py",
    "test_demo.py",
    "test_docs.py",
    "test_dropout.py",
    "test_emulate.py",
    "test_faults.py",
    "test_layout.py",
    "test_megatron_checkpoints.py",
    "test_megatron_combinations.py",
    "test_megatron_hybrid.py",
    "test_megatron_launch.py",
    "test_megatron_window.py",
    "test_misuse.py",
    "test_one_process.py",
    "test_own_rows.py",
    "test_peers.py",
    "test_placement_maps.py",
    "test_spawn.py",
    "test_timed_kernel.py",
    "test_varlen.py",
    "test_window.py",
)
"""``--half 2``'s test files; ``--half 1`` runs every other one (``0``: all). The README's
test command (``scripts/run_tests.sh``) runs its selection as two pytest processes side by
side, one per half: the suite's ranks mostly wait on each other, so one process keeps ~1.1
of the 2 cores busy. Chosen from a ``--durations=0`` run (2026-12-06) so that the halves
take about as long both in ``all`` and in ``ci-1``. A test file that uses the emulated
cluster's network namespaces must be in this half (one process makes them at a time)."""


def in_half(filename: str, half: int) -> bool:
    """Whether ``--half half`` (one of ``HALVES``) runs the test file ``filename``."""
    if half not in HALVES:
        raise ValueError(f"--half {half!r}: expected one of {', '.join(map(str, HALVES))}")
    return half == 0 or (filename in SECOND_HALF_FILES) == (half == 2)


def in_lane(filename: str, lane: str) -> bool:
    """Whether ``lane`` (one of ``LANES``) runs the test file ``filename``."""
    if lane not in LANES:
        raise ValueError(f"--lane {lane!r}: expected one of {', '.join(LANES)}")
    both = in_megatron_lanes(filename)
    moved = filename in CI_LANE_2_FILES
    return {
        "all": True,
        "stack": in_stack_lane(filename),
        "ci-1": both or not moved,
        "ci-2": both or moved,
    }[lane]
