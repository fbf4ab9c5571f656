"""The two CI lanes' selections (``.ci/run``).

Lane 1 (``scripts/run_tests.sh``, Python 3.11, megatron-core 0.16.1) runs every test. Lane 2
(``scripts/run_tests_py312.sh``, Python 3.12, megatron-core 0.19.2) runs ``--lane stack``:
the test files whose code paths import megatron-core, DeepSpeed or transformers, the only
code that differs between the lanes (the core imports none of them, and both lanes pin the
same torch release). ``test_imports.py`` checks that every test file importing one of them
is in ``STACK_TEST_FILES``, so a new adapter test cannot miss lane 2.
"""

from __future__ import annotations

from fnmatch import fnmatch

__all__ = ["LANES", "STACK_TEST_FILES", "in_stack_lane"]

LANES = ("all", "stack")

STACK_TEST_FILES = (
    "test_megatron*.py",
    "test_deepspeed*.py",
    "test_dit.py",
    "test_imports.py",
)
"""Test files (globs on the file name) that lane 2 runs."""


def in_stack_lane(filename: str) -> bool:
    return any(fnmatch(filename, pat) for pat in STACK_TEST_FILES)
