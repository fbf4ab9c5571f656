#!/usr/bin/env bash
# The Python 3.12 test lane: megatron-core 0.19.2 (every megatron-core wheel from 0.17
# needs Python >= 3.12) and torch 2.13.0's CUDA build, the only one PyPI has for 3.12
# (several GB, downloaded once into a wheelhouse outside the clone; see setup_env.sh).
# Sets the lane up from nothing in .venv-py312 and runs, through scripts/run_tests.sh (lint,
# then the tests in two halves side by side), the tests of the code that imports
# megatron-core, DeepSpeed or transformers on it (``--lane stack``: tests/lanes.py; lane 1,
# scripts/run_tests.sh, runs every test), or the pytest arguments given (``tests`` for all).
# PYTHON312=interpreter picks the Python (default: python3.12, or pyenv's newest 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
# Modules scripts/compile_imports.py did not reach are compiled once, not in every rank.
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON312:-}
if [ -z "$PY" ]; then
    for c in python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12; do
        if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            PY=$c
        fi
    done
fi
if [ -z "$PY" ]; then
    echo "run_tests_py312.sh: no Python 3.12 found; set PYTHON312 to one" >&2
    exit 2
fi
export PYTHON=$PY VENV=${VENV:-.venv-py312}
[ $# -gt 0 ] || set -- --lane stack
exec bash scripts/run_tests.sh "$@"
