#!/usr/bin/env bash
# The main job: sets up the environment from nothing and trains a tiny GPT with
# StarTrail context parallelism on 4 CPU ranks (CP = 4, team size C = 2, mock data).
# Extra arguments go to the training entry point (e.g. --train-iters 10).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${STARTRAIL_SKIP_SETUP:-}" ] || bash scripts/setup_env.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m startrail_megatron.pretrain_gpt \
  --nproc 4 --context-parallel-size 4 --context-parallel-impl startrail --startrail-team-size 2 \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
  --seq-length 128 --micro-batch-size 2 --mock-data --lr 3e-3 --train-iters 30 "$@"
