#!/bin/bash
# What a second replica of a slow block buys, measured (issue 12): the
# local cluster with replicas 1,1 and 2,1 of
# configs/bench/resnet_k2_slow_block0.pbtxt (block 0 ~3.8x block 1), run
# alternately; per run the mean wall and virtual step time over steps
# SKIP+. Every worker runs one intra-op thread, so 2,1 asks
# for three busy cores: on a machine with fewer, the measured gain is
# capped by the cores, not by the schedule (the virtual clock shows what
# one core per replica would give).
#
#   bash tests/bench/replicas.sh [ROUNDS]   (env: BUILD, STEPS, SKIP, MODE, REDUCTION)
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/bench/bench_lib.sh
BUILD=${BUILD:-build}
CONFIG=${CONFIG:-configs/bench/resnet_k2_slow_block0.pbtxt}
STEPS=${STEPS:-30}
SKIP=${SKIP:-5}
MODE=${MODE:-1}
REDUCTION=${REDUCTION:-ordered}
ROUNDS=${1:-3}
CLI=${INTERLOCK:-$BUILD/coordinator/interlock}

echo "replicas.sh: $CONFIG, mode $MODE, $STEPS steps (mean over steps" \
  "$SKIP+), reduction $REDUCTION; $(nproc) cores, load" \
  "$(cut -d' ' -f1-3 /proc/loadavg)"
printf "round replicas wall_s_per_step virtual_s_per_step\n"
for r in $(seq "$ROUNDS"); do
  for replicas in 1,1 2,1; do
    dir=$(mktemp -d /tmp/interlock-replicas.XXXXXX)
    # shellcheck disable=SC2046
    "$CLI" train --config "$CONFIG" --engine cluster --replicas "$replicas" \
      $(mode_flags "$MODE") --reduction "$REDUCTION" --steps "$STEPS" \
      --out "$dir/out" --quiet >"$dir/log" 2>&1 ||
      { cat "$dir/log"; exit 1; }
    python3 - "$dir/out/metrics.jsonl" "$SKIP" "$r" "$replicas" <<'PY'
import json, statistics, sys
path, skip, r, replicas = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
lines = [json.loads(l) for l in open(path)]
def mean_step(key):
    # Steps finish in bursts (the runner records them as they come), so
    # the mean over the counted steps, not the median of differences.
    t = [l[key] for l in lines]
    return (t[-1] - t[skip - 1]) / (len(t) - skip)
wall, virt = mean_step("wall_seconds"), mean_step("virtual_seconds")
print(f"{r} {replicas} {wall:.4f} {virt:.4f}")
PY
    rm -rf "$dir"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
