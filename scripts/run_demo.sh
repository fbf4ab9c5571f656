#!/usr/bin/env bash
# Sets up the environment from nothing and runs the demo on CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m startrail_megatron.demo "$@"
