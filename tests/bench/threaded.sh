#!/usr/bin/env bash
# The threaded schedule against the sequential one (issue "Performance III",
# item 3; figures in docs/BENCHMARKS.md "In-process step time"). For each
# case it runs PAIRS alternating pairs, sequential then threaded (the order
# swapped every other pair), of
#   OMP_NUM_THREADS=1 interlock train --config CONFIG <case flags>
#       --steps STEPS --threads-per-block 1 --schedule S --quiet --out DIR
# and prints, per pair, the time per step of each (wall_seconds of the last
# step minus that of step 11 in metrics.jsonl, over the steps between) and
# threaded's speed over sequential's (sequential time / threaded time), then
# the median ratio per case.
#
#   bash tests/bench/threaded.sh
#   (env: BUILD=build, CONFIG=configs/bench/resnet_ref_k4.pbtxt, STEPS=40,
#   PAIRS=5, CASES="e2e e2e-m4 2way")
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
CONFIG=${CONFIG:-configs/bench/resnet_ref_k4.pbtxt}
STEPS=${STEPS:-40}
PAIRS=${PAIRS:-5}
CASES=${CASES:-"e2e e2e-m4 2way"}
CLI=$BUILD/coordinator/interlock
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

flags() {
  case $1 in
    e2e) echo "--mode e2e" ;;
    e2e-m4) echo "--mode e2e --microbatches 4" ;;
    2way) echo "--mode interlock --n 2" ;;
    *) echo "unknown case $1" >&2; exit 2 ;;
  esac
}
# step_time DIR: seconds per step after the first 12 steps.
step_time() {
  awk -F'"wall_seconds":' '{ split($2, a, ","); w[NR] = a[1] }
    END { printf "%.4f", (w[NR] - w[12]) / (NR - 12) }' "$1/metrics.jsonl"
}
run() {  # run CASE SCHEDULE -> seconds per step
  local dir=$TMP/$1-$2
  rm -rf "$dir"
  # shellcheck disable=SC2046
  OMP_NUM_THREADS=1 "$CLI" train --config "$CONFIG" $(flags "$1") \
    --steps "$STEPS" --threads-per-block 1 --schedule "$2" --quiet \
    --out "$dir" >/dev/null
  step_time "$dir"
}

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); $(git rev-parse --short HEAD); $CONFIG, $STEPS steps"
for c in $CASES; do
  ratios=()
  for ((p = 1; p <= PAIRS; ++p)); do
    if ((p % 2)); then
      s=$(run "$c" sequential); t=$(run "$c" threaded)
    else
      t=$(run "$c" threaded); s=$(run "$c" sequential)
    fi
    r=$(awk -v s="$s" -v t="$t" 'BEGIN { printf "%.3f", s / t }')
    ratios+=("$r")
    echo "$c pair $p: sequential $s s/step, threaded $t s/step, threaded speed / sequential $r"
  done
  echo "$c median threaded speed / sequential: $(printf '%s\n' "${ratios[@]}" | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }')"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
