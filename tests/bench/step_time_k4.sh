#!/usr/bin/env bash
# Step time per mode, in process and on the cluster, for the two K = 4 ready
# configs (issue 4; results in docs/BENCHMARKS.md). A benchmark, not a test.
#
# Runs tests/bench/cluster_vs_inprocess.sh once per config, with the config's
# own micro-batch count, one intra-op thread per block, the in-process engine
# in the sequential schedule and the cluster as one interlock-worker per block
# on loopback, for modes e2e, 1, 2 (FURTHEST) and 2sum (SUM). The test split is
# capped (MAX_TEST): only the end-of-run evaluation, outside the timed steps,
# gets shorter. The Transformer takes about 1.1 s per step in process on an
# idle machine, so it gets fewer steps and rounds. The whole benchmark took
# 23 minutes on the 2-core machine fully loaded by other work; idle, about
# 10-12 minutes (estimated).
#
# Settings (environment variables):
#   MODES="e2e 1 2 2sum"
#   FMNIST_STEPS=30 FMNIST_WARMUP=5 FMNIST_ROUNDS=3
#   KJV_STEPS=10 KJV_WARMUP=3 KJV_ROUNDS=2
#   ONLY=fmnist|kjv    run one of the two
#   KEEP=DIR           keep the run folders (DIR/fmnist, DIR/kjv)
set -euo pipefail

cd "$(dirname "$0")/../.."

MODES=${MODES:-"e2e 1 2 2sum"}
ONLY=${ONLY:-}

run() {  # name config steps warmup rounds max_test
  if [[ -n "$ONLY" && "$ONLY" != "$1" ]]; then return 0; fi
  local keep=()
  if [[ -n "${KEEP:-}" ]]; then keep=(KEEP="$KEEP/$1"); fi
  env "${keep[@]}" CONFIG="$2" MS=file STEPS="$3" WARMUP="$4" ROUNDS="$5" \
    MAX_TEST="$6" MODES="$MODES" bash tests/bench/cluster_vs_inprocess.sh
  echo
}

run fmnist configs/fmnist_resnet_k4.pbtxt "${FMNIST_STEPS:-30}" \
  "${FMNIST_WARMUP:-5}" "${FMNIST_ROUNDS:-3}" 500
run kjv configs/kjv_transformer_k4.pbtxt "${KJV_STEPS:-10}" \
  "${KJV_WARMUP:-3}" "${KJV_ROUNDS:-2}" 256
