#!/usr/bin/env bash
# One-device check of StarTrail's attention backends.
#
#   bash scripts/gpu_check.sh [--out gpu_check.json] [--budget-s 420] [--no-timing]
#   bash scripts/gpu_check.sh --cpu            # tiny sizes on the CPU (what CI runs)
#
# On one GPU: checks every backend that can run here (flash-attn 2, PyTorch's
# CUDA flash / cuDNN / efficient SDPA ops, Transformer Engine's fused attention
# when TE is installed, the CPU-capable ones; the others are listed as skipped
# with the reason) inside the one-process StarTrail mode against a float64
# reference, then times StarTrail's per-rank compute (P = 8, C = 1 and 2, 8K
# tokens per rank, head_dim 128, 32 q / 8 kv heads, bf16) against one call of
# the same backend on the whole sequence. Prints a table, writes a JSON, exits
# 1 if a check fails.
#
# Installs nothing from the network. It uses the Python of $PYTHON (default
# python3) with the torch already there; wheels carried in $WHEELS (a folder,
# e.g. a flash-attn wheel built for that torch) are installed offline first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $PY has no torch; set PYTHON to an interpreter that has one" >&2
    exit 2
fi
if [ -n "${WHEELS:-}" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl \
        || echo "gpu_check: could not install the wheels in $WHEELS; going on without them" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m startrail_megatron.gpu_check "$@"
