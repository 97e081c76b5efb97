#!/bin/bash
# What the replica reduction costs per step, against the link model (issue
# 12): replicas 2,1 of configs/bench/resnet_k2_slow_block0.pbtxt with ORDERED
# and RING, on workers started here so that their metrics can be read after
# the run. A reduction is the wait for the block's slowest replica (its
# first, small exchange: interlock_worker_reduction_wait_seconds) and then
# the gradients' own exchange (the rest of
# interlock_worker_compute_seconds{phase="reduction"}); the link model
# prices only the exchange (the run's timeline, "reduce" events).
#
#   bash tests/bench/reduction.sh [ROUNDS]   (env: BUILD, STEPS, MODE)
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/bench/bench_lib.sh
BUILD=${BUILD:-build}
CONFIG=${CONFIG:-configs/bench/resnet_k2_slow_block0.pbtxt}
STEPS=${STEPS:-30}
MODE=${MODE:-1}
ROUNDS=${1:-2}
CLI=$BUILD/coordinator/interlock
WORKER=$BUILD/worker/interlock-worker

echo "reduction.sh: $CONFIG, mode $MODE, $STEPS steps, replicas 2,1;" \
  "$(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
printf "round reduction replica reductions total_ms wait_ms exchange_ms model_ms\n"
for r in $(seq "$ROUNDS"); do
  for reduction in ordered ring; do
    dir=$(mktemp -d /tmp/interlock-reduction.XXXXXX)
    pids=()
    for i in 0 1 2; do
      "$WORKER" --host 127.0.0.1 --port 0 --port_file "$dir/w$i.port" \
        --metrics_port 0 >"$dir/w$i.log" 2>&1 &
      pids+=($!)
    done
    for i in 0 1 2; do
      for _ in $(seq 600); do [[ -s $dir/w$i.port ]] && break; sleep 0.1; done
    done
    addr() { echo "127.0.0.1:$(cut -d' ' -f1 "$dir/w$1.port")"; }
    # shellcheck disable=SC2046
    if ! "$CLI" train --quiet --engine cluster --config "$CONFIG" \
      --workers "$(addr 0)+$(addr 1),$(addr 2)" $(mode_flags "$MODE") \
      --reduction "$reduction" --steps "$STEPS" --out "$dir/out" \
      >"$dir/cli.log" 2>&1; then
      echo "run failed:"; tail -5 "$dir/cli.log"; kill "${pids[@]}"; exit 1
    fi
    for i in 0 1; do
      python3 - "$r" "$reduction" "$i" "$(cut -d' ' -f2 "$dir/w$i.port")" \
        "$dir/out/timeline.json" <<'PY'
import json, statistics, sys, urllib.request
r, reduction, replica, port, timeline = sys.argv[1:]
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
def total(name, label=""):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(name + "{") and label in l)
phase = 'phase="reduction"'
n = total("interlock_worker_compute_seconds_count", phase)
all_s = total("interlock_worker_compute_seconds_sum", phase)
wait = total("interlock_worker_reduction_wait_seconds_sum")
events = json.load(open(timeline))["traceEvents"]
model = statistics.median(e["dur"] for e in events if e.get("name") == "reduce")
print(r, reduction, replica, int(n), "%.2f" % (1e3 * all_s / n),
      "%.2f" % (1e3 * wait / n), "%.2f" % (1e3 * (all_s - wait) / n),
      "%.2f" % (model / 1e3))
PY
    done
    kill "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$dir"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
