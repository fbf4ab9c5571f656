#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs the pinned
# dependencies of constraints.txt for the interpreter's test lane: Python 3.11 gets
# megatron-core 0.16, Python 3.12 megatron-core 0.19 (every release from 0.17 needs 3.12).
# Usage: bash scripts/setup_env.sh   (PYTHON=interpreter, VENV=path to use others)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch alone and first, from the pin: never let a dependency pull a second build.
if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    # Python >= 3.12: only a CUDA build of torch exists (several GB, with its CUDA
    # libraries). Downloaded once into a wheelhouse kept outside the clone, installed
    # from there with no index: pip's own cache does not keep these downloads here.
    WHEELS=${STARTRAIL_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/startrail_megatron/wheels}
    mkdir -p "$WHEELS"
    if ! $PIP install --no-index --find-links "$WHEELS" -c constraints.txt torch 2>/dev/null; then
        $PIP download -c constraints.txt -d "$WHEELS" torch
        $PIP install --no-index --find-links "$WHEELS" -c constraints.txt torch
    fi
else
    $PIP install -c constraints.txt torch
fi
DS_BUILD_OPS=0 $PIP install -c constraints.txt -e ".[dev,megatron,deepspeed]"
