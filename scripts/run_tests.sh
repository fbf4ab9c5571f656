#!/usr/bin/env bash
# Sets up the environment from nothing and runs the whole test suite.
#
# With no arguments but --lane (and "tests"), the suite runs as its two halves (tests/lanes.py
# SECOND_HALF_FILES) in two pytest processes side by side: its ranks mostly wait on each
# other, so one process keeps ~1.1 of the 2 cores busy. The second half's output follows
# the first's; red if either fails. Any other argument (a test file, -k, ...) runs one
# pytest with the arguments given; STARTRAIL_TEST_HALVES=0 does too.
set -euo pipefail
cd "$(dirname "$0")/.."
# Modules scripts/compile_imports.py did not reach are compiled once, not in every rank.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
"$VENV/bin/python" -m ruff check startrail_megatron tests scripts
"$VENV/bin/python" -m ruff format --check startrail_megatron tests scripts
# "tests" (every test file, as in `run_tests_py312.sh tests`) is what pytest runs without a
# path (pyproject.toml's testpaths), so it is dropped; a test file given runs alone. Any
# argument but --lane and its value runs one process.
args=()
halves=${STARTRAIL_TEST_HALVES:-1}
prev=
for a in "$@"; do
    case "$prev:$a" in
        --lane:*) ;;
        *:tests | *:tests/) prev= && continue ;;
        *:--lane | *:--lane=*) ;;
        *) halves=0 ;;
    esac
    args+=("$a")
    prev=$a
done
set -- ${args[@]+"${args[@]}"}
if [ "$halves" = 0 ]; then
    exec "$VENV/bin/python" -m pytest -q "$@"
fi
half2=
log=$(mktemp -t startrail_half2.XXXXXX)
trap '[ -z "$half2" ] || kill -- -"$half2" 2>/dev/null; rm -f "$log"' EXIT
set -m  # the second half in its own process group: killed whole if the first is interrupted
"$VENV/bin/python" -m pytest -q --half 2 "$@" </dev/null >"$log" 2>&1 &
half2=$!
set +m
rc1=0
"$VENV/bin/python" -m pytest -q --half 1 "$@" || rc1=$?
rc2=0
wait "$half2" || rc2=$?
half2=
echo "=== second half (pytest --half 2) ==="
cat "$log"
echo "=== first half exit $rc1, second half exit $rc2 ==="
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
