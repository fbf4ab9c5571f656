#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs the pinned
# dependencies. Usage: bash scripts/setup_env.sh   (VENV=path to use another place)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch alone and first, from the pin: never let a dependency pull a CUDA build.
$PIP install -c constraints.txt torch
DS_BUILD_OPS=0 $PIP install -c constraints.txt -e ".[dev,megatron,deepspeed]"
