#!/usr/bin/env bash
# Cluster versus in-process benchmark (issue "Cluster"; results in
# docs/BENCHMARKS.md). A benchmark, not a test: it is not part of ctest.
#
# By default K = 2 blocks (configs/bench/resnet_k2.pbtxt: the reference ResNet
# cut in two, batch 64), one intra-op thread per block; tests/bench/
# step_time_k4.sh runs it on the K = 4 ready configs (issue 4). For M = 1 and a copy with
# microbatches: 4, and for E2E and 1-way, it runs
#   interlock train --config C <mode flags> --engine inprocess|cluster
#       --threads-per-block 1 --schedule sequential --quiet --steps N --out DIR
# in ROUNDS rounds; within a round both engines run back to back for each
# (config, mode), the engine order alternating and the (config, mode) order
# rotating from round to round. `--engine cluster` launches two local
# interlock-worker processes on loopback and stops them at the end. While a run
# goes, the CPU time of the CLI and of each worker is sampled from /proc.
# tests/bench/cluster_vs_inprocess.py does the runs and prints Markdown tables:
# median step time, samples/s, cluster / in-process ratios, CPU use per process.
#
# Settings (environment variables):
#   STEPS=30     optimizer steps per run
#   ROUNDS=4     rounds
#   WARMUP=5     leading steps of every run left out of the statistics
#   MODES="e2e 1"          e2e, N (N-way, FURTHEST rule) or Nsum (SUM rule);
#                          for K = 2, 2-way trains like E2E
#   MS="1 4"               micro-batches per step (copies of the config);
#                          MS=file runs the config's own value
#   CONFIG=configs/bench/resnet_k2.pbtxt
#   MAX_TEST=N   cap the test split at N samples (adds max_test to the copy's
#                data section): only the end-of-run evaluation, outside the
#                timed steps, gets shorter
#   POLL=0.2     seconds between CPU samples
#   INTERLOCK=build/coordinator/interlock (finds build/worker/interlock-worker)
#   KEEP=DIR     keep the run folders and runs.jsonl in DIR (default: a
#                temporary folder, removed at the end)
set -euo pipefail

cd "$(dirname "$0")/../.."

STEPS=${STEPS:-30}
ROUNDS=${ROUNDS:-4}
WARMUP=${WARMUP:-5}
MODES=${MODES:-"e2e 1"}
MS=${MS:-"1 4"}
CONFIG=${CONFIG:-configs/bench/resnet_k2.pbtxt}
POLL=${POLL:-0.2}
INTERLOCK=${INTERLOCK:-build/coordinator/interlock}

if [[ ! -x "$INTERLOCK" ]]; then
  echo "cluster_vs_inprocess.sh: $INTERLOCK not found; run 'make build' first" >&2
  exit 2
fi
if (( STEPS < WARMUP + 1 )); then
  echo "cluster_vs_inprocess.sh: STEPS=$STEPS leaves no timed steps after WARMUP=$WARMUP" >&2
  exit 2
fi

if [[ -n "${KEEP:-}" ]]; then
  work=$KEEP
  mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/interlock-cluster-bench.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
: >"$work/runs.jsonl"

name=$(basename "$CONFIG" .pbtxt)
config_args=()
for m in $MS; do
  if [[ $m == file ]]; then
    f="$work/$name.pbtxt"
    cp "$CONFIG" "$f"
    run_name=$name
  else
    f="$work/${name}_m$m.pbtxt"
    sed "s/^\( *microbatches:\) *[0-9]*/\1 $m/" "$CONFIG" >"$f"
    if ! grep -q "^ *microbatches: $m\$" "$f"; then
      echo "cluster_vs_inprocess.sh: cannot set microbatches: $m in $CONFIG" >&2
      exit 2
    fi
    run_name=${name}_m$m
  fi
  if [[ -n "${MAX_TEST:-}" ]]; then
    sed -i "s/^\(data { kind: [A-Z_]*\) }/\1 max_test: $MAX_TEST }/" "$f"
    if ! grep -q "max_test: $MAX_TEST }" "$f"; then
      echo "cluster_vs_inprocess.sh: cannot add max_test to the data line" \
        "of $CONFIG (expected 'data { kind: K }')" >&2
      exit 2
    fi
  fi
  config_args+=(--config "$run_name=$f")
done

echo "cluster_vs_inprocess.sh: $ROUNDS rounds x M [$MS] x modes [$MODES] x" \
  "engines [inprocess cluster], $STEPS steps each, 1 thread per block" >&2
echo "Median step time, $name, 1 thread per block, sequential schedule," \
  "$ROUNDS rounds x $STEPS steps (first $WARMUP dropped)."
echo
python3 tests/bench/cluster_vs_inprocess.py --work "$work" \
  --interlock "$INTERLOCK" "${config_args[@]}" --modes "$MODES" \
  --engines "inprocess cluster" --rounds "$ROUNDS" --steps "$STEPS" \
  --warmup "$WARMUP" --threads 1 --poll "$POLL"
