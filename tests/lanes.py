"""The test lanes' selections (``pytest --lane``; CI's two lanes in ``.ci/run``).

``all`` (the default; ``scripts/run_tests.sh``, the README's test command): every test.
``stack``: the test files whose code paths import megatron-core, DeepSpeed or transformers,
the only code that differs between Python 3.11 (megatron-core 0.16.1) and Python 3.12
(megatron-core 0.19.2): the core imports none of them, and both pin the same torch release
(``scripts/run_tests_py312.sh`` runs this lane by default).

CI (``.ci/run``) runs two lanes side by side on the 2 cores: ``ci-1`` on Python 3.11 (every
test file but ``CI_LANE_2_CORE_FILES``) and ``ci-2`` on Python 3.12 (the stack's files and
``CI_LANE_2_CORE_FILES``). So every test runs in CI, the stack's on both megatron-core
releases, and the lanes end about together instead of lane 2 waiting idle for lane 1.
``test_imports.py`` checks that every test file importing the stack is in
``STACK_TEST_FILES`` (a new adapter test cannot miss the second release) and that the moved
files import none of it.
"""

from __future__ import annotations

from fnmatch import fnmatch

__all__ = ["CI_LANE_2_CORE_FILES", "LANES", "STACK_TEST_FILES", "in_lane", "in_stack_lane"]

LANES = ("all", "stack", "ci-1", "ci-2")

STACK_TEST_FILES = (
    "test_megatron*.py",
    "test_deepspeed*.py",
    "test_dit.py",
    "test_imports.py",
)
"""Test files (globs on the file name) that the ``stack`` lane runs."""

CI_LANE_2_CORE_FILES = ("test_attention.py", "test_window.py", "test_comm.py")
"""Core test files (no stack import) that CI runs on its Python 3.12 lane instead of its
Python 3.11 one: ~100 s of the 3.11 lane's 580 s, which ended ~200 s after the 3.12 lane."""


def in_stack_lane(filename: str) -> bool:
    return any(fnmatch(filename, pat) for pat in STACK_TEST_FILES)


def in_lane(filename: str, lane: str) -> bool:
    """Whether ``lane`` (one of ``LANES``) runs the test file ``filename``."""
    if lane not in LANES:
        raise ValueError(f"--lane {lane!r}: expected one of {', '.join(LANES)}")
    moved = filename in CI_LANE_2_CORE_FILES
    return {
        "all": True,
        "stack": in_stack_lane(filename),
        "ci-1": not moved,
        "ci-2": moved or in_stack_lane(filename),
    }[lane]
