#!/usr/bin/env bash
# The chaos soak (docs/RELIABILITY.md "Chaos soak"): one run with block
# replicas on workers started by hand on loopback, where seeded random
# faults (kill -9 of a replica, SIGSTOP past the hang timeout, SIGTERM, kill
# -9 of the coordinator) strike one after another while a supervisor starts
# exited workers again on their ports; the run must end bitwise on the
# uninterrupted run with every micro-batch applied once. It is the test
# ChaosSoak.RandomFaultsOnReplicasAndTheCoordinatorEndBitwise (whose short
# version `make test` runs) at full length; it prints faults by kind with
# the time each took to get past the step the run had reached, and writes
# the same report to REPORT.
#
#   bash tests/bench/chaos_soak.sh [FAULTS]      # default 200
#   (env: BUILD=build, SEED (default random), STEPS (default 250 x FAULTS
#   + 500), REPORT (default /tmp/chaos_soak.txt))
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
FAULTS=${1:-200}
REPORT=${REPORT:-${TMPDIR:-/tmp}/chaos_soak.txt}
STEPS=${STEPS:-$((250 * FAULTS + 500))}
env INTERLOCK_SOAK_FAULTS="$FAULTS" \
  ${SEED:+INTERLOCK_SOAK_SEED=$SEED} INTERLOCK_SOAK_STEPS="$STEPS" \
  INTERLOCK_SOAK_REPORT="$REPORT" \
  "$BUILD/tests/interlock_soak_tests" \
  --gtest_filter=ChaosSoak.RandomFaultsOnReplicasAndTheCoordinatorEndBitwise
echo "report: $REPORT"
