#!/bin/bash
# The second example: a real corpus that ships with the machine (the Python standard
# library's modules), a tokenizer trained on it, Megatron's .bin/.idx, and a small GPT
# trained with StarTrail at CP = 4 (C = 2) on 4 CPU ranks, validation loss every 50
# iterations. Sets up the environment first, as the README's main command does
# (STARTRAIL_SKIP_SETUP=1 skips it); extra arguments go to the training entry point.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${STARTRAIL_SKIP_SETUP:-}" ] || bash scripts/setup_env.sh
VENV=${VENV:-.venv}
OUT=${OUT:-data/stdlib}
# 1. text -> corpus.jsonl and a tokenizer directory (no download)
"$VENV/bin/python" -m startrail_megatron.megatron.training.corpus --out "$OUT"
# 2. text -> tokens (.bin/.idx), as Megatron-LM's tools/preprocess_data.py
"$VENV/bin/startrail-preprocess-data" --input "$OUT/corpus.jsonl" --output-prefix "$OUT/stdlib" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/tokenizer" --append-eod
# 3. train, with Megatron-LM's flags
exec "$VENV/bin/python" -m startrail_megatron.pretrain_gpt \
  --nproc 4 --context-parallel-size 4 --context-parallel-impl startrail --startrail-team-size 2 \
  --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 512 \
  --micro-batch-size 4 --train-iters 300 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
  --lr-warmup-iters 20 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --data-path "$OUT/stdlib_text_document" --split 949,50,1 --data-cache-path "$OUT/cache" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/tokenizer" \
  --eval-interval 50 --eval-iters 5 --log-interval 25 --log-json "$OUT/log.json" "$@"
