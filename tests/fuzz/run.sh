#!/usr/bin/env bash
# Runs every fuzz target of a fuzz build for a given time, one after another,
# from the seed corpus in tests/fuzz/corpus. Prints libFuzzer's final stats of
# each run; exits non-zero when a target finds a crash or a leak (the
# reproducer is in BUILD/fuzz-artifacts).
# Usage: tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...]
set -euo pipefail

BUILD="$1"
SECONDS_EACH="$2"
shift 2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARGETS=("$@")
if ((${#TARGETS[@]} == 0)); then
  TARGETS=(fuzz_tensor_decoder fuzz_worker_messages fuzz_checkpoint_reader
    fuzz_codec_payload)
fi

mkdir -p "$BUILD/fuzz-artifacts" "$BUILD/fuzz-logs"
status=0
for t in "${TARGETS[@]}"; do
  bin="$BUILD/tests/fuzz/$t"
  seeds="$ROOT/tests/fuzz/corpus/$t"
  work="$BUILD/fuzz-corpus/$t"  # grows here; the repository's seeds stay
  mkdir -p "$work"
  log="$BUILD/fuzz-logs/$t.log"
  echo "fuzz: $t for ${SECONDS_EACH}s (log $log)"
  set +e
  # One intra-op thread, as a worker runs. Every target keeps libFuzzer's
  # leak check (on by default): a leak is a failure like a crash.
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    "$bin" -max_total_time="$SECONDS_EACH" -print_final_stats=1 \
    -timeout=60 -rss_limit_mb=4096 -max_len=65536 \
    -artifact_prefix="$BUILD/fuzz-artifacts/$t-" "$work" "$seeds" >"$log" 2>&1
  rc=$?
  set -e
  grep -aE '^(#[0-9]+[[:space:]]+DONE|stat::)' "$log" | sed "s/^/  $t: /" || true
  if ((rc != 0)); then
    echo "fuzz: $t FAILED (exit $rc); see $log and $BUILD/fuzz-artifacts"
    tail -n 40 "$log"
    status=1
  fi
done
exit $status
