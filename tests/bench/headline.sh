#!/usr/bin/env bash
# The paper's headline as one command (issue 14; results in docs/results/).
# Not a test: it is not part of ctest.
#
#   tests/bench/headline.sh CONFIG OUTDIR [BUDGET]
#
# Runs `interlock compare` on CONFIG with E2E, 1-way, 2-way and 3-way, every
# mode once per seed, all stopped at the same *virtual* time BUDGET (the
# time the run would take with one accelerator per block), in process on
# one thread (compare's default), and then tests/bench/headline_stats.py,
# which writes OUTDIR/headline.md: each mode's virtual step against E2E's
# and the virtual time each run needs to reach E2E's final test metric.
#
# The rule of the interlocked modes is the config's (`rule: SUM` gives
# e2e,1,2sum,3sum; otherwise e2e,1,2,3 FURTHEST): the ready configs name the
# better rule for their model family (DESIGN §1).
#
# BUDGET and the evaluation cadence default per ready config, chosen so that
# both headlines together take about an hour on a 2-core machine
# (docs/results/*/README.md says how many steps each mode does):
#   fmnist_resnet_k4    35s, compare's cadence (about 10 evaluations a run)
#   kjv_transformer_k4  60s, an evaluation every 40 steps and at the end (one
#                       evaluation of the Transformer on its test split costs
#                       as much wall time as about 20 training steps)
#
# Settings (environment variables):
#   INTERLOCK=build/coordinator/interlock
#   SEEDS=1,2,3
#   MODES=...      overrides the modes derived from the config
#   EVAL_EVERY=N   evaluate every N steps: runs a copy of CONFIG with
#                  `eval_every_steps: N`, OUTDIR/config.pbtxt (0: compare's
#                  cadence)
#   NICE=19        niceness of the runs (0: none)
set -euo pipefail
if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: $0 CONFIG OUTDIR [BUDGET]" >&2
  exit 2
fi
config=$1
out=$2
cd "$(dirname "$0")/../.."
INTERLOCK=${INTERLOCK:-build/coordinator/interlock}
SEEDS=${SEEDS:-1,2,3}
NICE=${NICE:-19}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

name=$(sed -n 's/^name: *"\(.*\)".*/\1/p' "$config")
budget=${3:-}
case $name in
  fmnist_resnet_k4) default_budget=35s default_eval=0 ;;
  kjv_transformer_k4) default_budget=60s default_eval=40 ;;
  *) default_budget="" default_eval=0 ;;
esac
budget=${budget:-$default_budget}
if [[ -z $budget ]]; then
  echo "$0: no default budget for config '$name'; give BUDGET" >&2
  exit 2
fi
EVAL_EVERY=${EVAL_EVERY:-$default_eval}
if [[ -z ${MODES:-} ]]; then
  if grep -Eq '^ *rule: *SUM' "$config"; then
    MODES=e2e,1,2sum,3sum
  else
    MODES=e2e,1,2,3
  fi
fi

mkdir -p "$out"
if [[ $EVAL_EVERY != 0 ]]; then
  if grep -q 'eval_every_steps' "$config"; then
    echo "$0: $config sets eval_every_steps already; unset EVAL_EVERY" >&2
    exit 2
  fi
  sed "s/^training {\$/training {\n  eval_every_steps: $EVAL_EVERY/" \
    "$config" >"$out/config.pbtxt"
  grep -q "eval_every_steps: $EVAL_EVERY" "$out/config.pbtxt"
  config=$out/config.pbtxt
fi
{
  echo "start: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "nproc: $(nproc --all)"
  echo "cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$out/machine.txt"

cmd=("$INTERLOCK" compare --config "$config" --modes "$MODES"
     --seeds "$SEEDS" --budget-virtual "$budget" --out "$out")
if [[ $NICE != 0 ]]; then
  cmd=(nice -n "$NICE" "${cmd[@]}")
fi
echo "${cmd[*]}" | tee -a "$out/machine.txt" >&2
status=0
"${cmd[@]}" || status=$?
{
  echo "end: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "compare exit status: $status"
} >>"$out/machine.txt"
python3 tests/bench/headline_stats.py "$out" >"$out/headline.md" || status=1
cat "$out/headline.md"
exit "$status"
