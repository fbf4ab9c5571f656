#!/usr/bin/env bash
# Runs upstream Megatron-LM's own pretrain_gpt.py, unmodified, on CPU ranks through StarTrail's
# launcher (python -m startrail_megatron.launch): a tiny GPT, 4 iterations on mock data.
#
#   git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_r0.16.0
#   MEGATRON_LM=Megatron-LM bash scripts/megatron_lm_cpu/run.sh 4 \
#       --context-parallel-size 4 --context-parallel-impl startrail --startrail-team-size 2
#
# The first argument is the number of ranks (gloo, under torchrun; default 1); the others
# are appended to the tiny GPT's flags below (a later flag wins). Each rank runs runner.py,
# which emulates torch.cuda on the CPU (cuda_on_cpu.py) and readies Megatron-LM's training
# package for CPU ranks at run time. It checks the Megatron adapter against the real
# Megatron-LM: compare the printed `lm loss` of CP = 1 with that of a StarTrail run.
#
#   MEGATRON_LM   a Megatron-LM checkout; with MLM_REF, any git repository of Megatron-LM
#                 (a clone, or a bare one)
#   MLM_REF       a branch, tag or commit of MEGATRON_LM: its files are exported (git archive)
#                 into a temporary folder, removed at exit, and run from there
#   PY            the interpreter, with this project installed (default: .venv/bin/python)
#   MLM_CPU_DEPS  where the packages that Megatron-LM's training imports and this project
#                 does not install (six, triton: ~1 GB) go, if PY lacks them: installed once
#                 with pip --target, on PYTHONPATH for this run only, never into PY's venv
#                 (default ~/.cache/startrail_megatron/megatron_lm_cpu/<python tag>)
#
# The Megatron-LM tree is not written to: its dataset helpers come prebuilt from PY's
# megatron-core wheel, its fused-kernel build step is skipped, and no bytecode is written
# (PYTHONDONTWRITEBYTECODE). Megatron-LM from 0.17 on needs Python >= 3.12 with a
# megatron-core wheel of the same release (PYTHON=python3.12 VENV=.venv-py312
# bash scripts/setup_env.sh, then PY=.venv-py312/bin/python).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/scripts/megatron_lm_cpu"
NPROC=${1:-1}
shift || true
PY=${PY:-$ROOT/.venv/bin/python}
die() {
    echo "megatron_lm_cpu: $*" >&2
    exit 2
}
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "the first argument is the number of ranks, not '$NPROC'"
command -v "$PY" >/dev/null \
    || die "PY=$PY is not an interpreter (set PY, or run scripts/setup_env.sh)"
[ -n "${MEGATRON_LM:-}" ] || die "set MEGATRON_LM to a Megatron-LM checkout" \
    "(git clone https://github.com/NVIDIA/Megatron-LM)"
[ -d "$MEGATRON_LM" ] || die "MEGATRON_LM=$MEGATRON_LM is not a folder"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/megatron_lm_cpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [ -n "${MLM_REF:-}" ]; then
    git -C "$MEGATRON_LM" rev-parse --verify -q "$MLM_REF^{commit}" >/dev/null 2>&1 \
        || die "MLM_REF=$MLM_REF is not a commit of the git repository MEGATRON_LM=$MEGATRON_LM"
    TREE="$WORK/Megatron-LM"
    mkdir "$TREE"
    git -C "$MEGATRON_LM" archive --format=tar "$MLM_REF" | tar -x -C "$TREE"
    [ -f "$TREE/pretrain_gpt.py" ] || die "MLM_REF=$MLM_REF of MEGATRON_LM has no pretrain_gpt.py"
else
    TREE=$(cd "$MEGATRON_LM" && pwd)
    [ -f "$TREE/pretrain_gpt.py" ] || die "MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py" \
        "(not a Megatron-LM checkout? or set MLM_REF to a ref of that git repository)"
fi

TAG=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
DEPS=${MLM_CPU_DEPS:-${XDG_CACHE_HOME:-$HOME/.cache}/startrail_megatron/megatron_lm_cpu/$TAG}
export PYTHONPATH="$ROOT:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
MISSING=$("$PY" -c 'import importlib.util as u
print(" ".join(p for p in ("six==1.17.0", "triton==3.9.0") if not u.find_spec(p.split("=")[0])))')
if [ -n "$MISSING" ]; then
    echo "megatron_lm_cpu: installing $MISSING into $DEPS (once; PY's packages stay)" >&2
    # shellcheck disable=SC2086  # one word per requirement
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$DEPS" $MISSING \
        || die "could not install $MISSING; install them for $PY, or into MLM_CPU_DEPS"
fi

export PYTHONDONTWRITEBYTECODE=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# mock data and the null tokenizer, unless the flags name data (--data-path: e.g. --sft data
# from sft_data.py for --hybrid-context-parallel, which Megatron-LM feeds from SFT data only)
DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 256)
for a in "$@"; do [ "$a" = --data-path ] && DATA=(); done
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    "$HERE/runner.py" --megatron-lm "$TREE" -m startrail_megatron.launch "$TREE/pretrain_gpt.py" \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 --train-iters 4 \
    --lr 1e-3 "${DATA[@]}" \
    --distributed-backend gloo --transformer-impl local --attention-dropout 0 --hidden-dropout 0 \
    --no-persist-layer-norm --no-gradient-accumulation-fusion \
    --log-interval 1 --eval-iters 0 --eval-interval 1000 "$@"
