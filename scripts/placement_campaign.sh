#!/usr/bin/env bash
# Issue 48's measurement: StarTrail under the computed placement map beside ring, the two
# named placements, the 2-D split and the peers, on emulated clusters whose node size the
# sub-ring length does or does not fit (root; nothing else running on the host).
#
#   bash scripts/placement_campaign.sh OUT_DIR [TOPOLOGY@RATE ...]
#
# Default topologies: 3x8 (P = 24, C = 2: G = 6 on nodes of 8), 3x4 (P = 12: G = 3 on nodes
# of 4), 6x2 (2 ranks per node), 2x6 (G = 3 fits nodes of 6), all at 200 Mbit/s, then 3x8
# at 100 and 400 Mbit/s. 4800 tokens, 24 heads of 16 (every U the split takes), fp32,
# causal, 1 warm-up and 3 repeats. Writes OUT_DIR/placement_<NxR>_<rate>.json and .png;
# `python scripts/emulated_table.py OUT_DIR/placement_*.json` makes the tables.
# BENCH_ARGS: more startrail-bench flags for every run, e.g. BENCH_ARGS="--timed-kernels 0"
# (kernels as waits of their modelled time: ranks compute side by side, Note [timed kernels]).
set -euo pipefail
out=${1:?usage: placement_campaign.sh OUT_DIR [TOPOLOGY@RATE ...]}
shift
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(3x8@200mbit 3x4@200mbit 6x2@200mbit 2x6@200mbit 3x8@100mbit 3x8@400mbit)
mkdir -p "$out"
py=${PYTHON:-python}
for run in "${runs[@]}"; do
  topo=${run%@*}; rate=${run#*@}
  nodes=${topo%x*}; per=${topo#*x}; p=$((nodes * per))
  case $p in
    24) strategies="ring startrail-C2-team startrail-C2-ring startrail-C2-map ring+ulysses2
        startrail-C2-ring+ulysses2 ring+ulysses3 startrail-C2-team+ulysses3 ring+ulysses8
        allgather ulysses" ;;
    12) strategies="ring startrail-C2-team startrail-C2-ring startrail-C2-map ring+ulysses2
        ring+ulysses3 startrail-C2-team+ulysses3 ring+ulysses4 allgather ulysses" ;;
    *) echo "no strategy list for P = $p" >&2; exit 2 ;;
  esac
  name="$out/placement_${topo}_${rate}"
  echo "== $topo at $rate ($(date -u +%H:%M:%S))"
  # shellcheck disable=SC2086
  "$py" -m startrail_megatron.bench --emulate "$topo" --inter-node "$rate" --seq-len 4800 \
    --heads 24 --head-dim 16 --repeats 3 --warmup 1 --auto-placement \
    --strategies $strategies ${BENCH_ARGS:-} --json "$name.json" --png "$name.png" \
    2>"$name.log" | tail -20
done
