#!/usr/bin/env bash
# Sets up the environment from nothing and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Modules scripts/compile_imports.py did not reach are compiled once, not in every rank.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
"$VENV/bin/python" -m ruff check startrail_megatron tests scripts
"$VENV/bin/python" -m ruff format --check startrail_megatron tests scripts
exec "$VENV/bin/python" -m pytest tests -q "$@"
