#!/usr/bin/env bash
# Soak benchmark (issue "Reliability"; results in docs/RELIABILITY.md). A
# benchmark, not a test: it is not part of ctest.
#
# Runs
#   interlock train --engine cluster --config configs/tests/tiny_resnet_k4.pbtxt
#       --steps STEPS --checkpoint-every CKPT --quiet --out DIR/run
# (a local cluster of 4 interlock-worker processes; 2 micro-batches per step,
# so the default 5000 steps are 10,000 micro-batches), samples the resident
# memory (VmRSS) of the coordinator and of every worker once a second, and
# prints each process's growth after warm-up (tests/bench/soak_stats.py).
# Exits non-zero when a process grew by WARN_PCT or more.
#
# Settings (environment variables):
#   STEPS=5000     optimizer steps (x 2 micro-batches)
#   CKPT=500       checkpoint every CKPT steps (0: none)
#   WARMUP=0.2     leading fraction of each process's samples left out
#   WARN_PCT=5     growth that fails the benchmark
#   INTERLOCK=build/coordinator/interlock
#   KEEP=DIR       keep the run folder and rss.tsv in DIR (default: temporary)
set -euo pipefail

cd "$(dirname "$0")/../.."

STEPS=${STEPS:-5000}
CKPT=${CKPT:-500}
WARMUP=${WARMUP:-0.2}
WARN_PCT=${WARN_PCT:-5}
INTERLOCK=${INTERLOCK:-build/coordinator/interlock}
if [[ -n "${KEEP:-}" ]]; then
  DIR=$KEEP
  mkdir -p "$DIR"
else
  DIR=$(mktemp -d /tmp/interlock-soak-XXXXXX)
  trap 'rm -rf "$DIR"' EXIT
fi
rm -rf "$DIR/run" "$DIR/rss.tsv"

"$INTERLOCK" train --quiet --engine cluster \
  --config configs/tests/tiny_resnet_k4.pbtxt --steps "$STEPS" \
  --checkpoint-every "$CKPT" --out "$DIR/run" >"$DIR/cli.log" 2>&1 &
CLI=$!
START=$(date +%s.%N)
printf 'seconds\tpid\trole\trss_kib\n' >"$DIR/rss.tsv"
while kill -0 "$CLI" 2>/dev/null; do
  NOW=$(date +%s.%N)
  T=$(awk -v a="$START" -v b="$NOW" 'BEGIN { printf "%.2f", b - a }')
  for P in "$CLI" $(pgrep -P "$CLI" -f interlock-worker || true); do
    RSS=$(awk '/^VmRSS:/ { print $2 }' "/proc/$P/status" 2>/dev/null || true)
    ROLE=worker
    [[ "$P" == "$CLI" ]] && ROLE=coordinator
    [[ -n "$RSS" ]] && printf '%s\t%s\t%s\t%s\n' "$T" "$P" "$ROLE" "$RSS" \
      >>"$DIR/rss.tsv"
  done
  sleep 1
done
if ! wait "$CLI"; then
  echo "soak: the run failed:" >&2
  tail -20 "$DIR/cli.log" >&2
  exit 1
fi
grep -h '^digest' "$DIR/cli.log" || true
python3 tests/bench/soak_stats.py "$DIR/rss.tsv" "$WARMUP" "$WARN_PCT"
