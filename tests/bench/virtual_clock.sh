#!/usr/bin/env bash
# Virtual-clock benchmarks (issue 4; results in docs/BENCHMARKS.md). Not a
# test: it is not part of ctest.
#
# 1. Fidelity (K = 2, where the machine's 2 cores give real parallelism): the
#    reference ResNet cut in two (configs/bench/resnet_k2.pbtxt), two
#    interlock-worker processes with one intra-op thread each, modes E2E,
#    1-way and 2-way (= FURTHEST, which at K = 2 trains like E2E but with a
#    head on block 0), M = 1 and 4. The wall step time measured by the
#    coordinator is set against two predictions: the run's own virtual clock
#    (the replay of the durations these workers measured) and
#    `interlock simulate` from the profile of an in-process sequential run
#    of the same mode (durations measured without contention).
# 2. Fidelity at K = 4 (issue 14), where 2 cores cannot run four blocks in
#    parallel, so the measure is the virtual clock: each ready config
#    (fmnist_resnet_k4: E2E, 1-, 2-, 3-way FURTHEST; kjv_transformer_k4: E2E,
#    1-, 2-, 3-way SUM) runs every mode in process on one thread, and
#    `interlock simulate` from each run's profile predicts every mode. A
#    prediction is set against the virtual step time of the *other* mode's
#    own run: the cost model (which passes a mode runs, what they cost)
#    is what is checked, not the replay of a run's own durations.
#
# Settings (environment variables):
#   STEPS=30 FID_WARMUP=8        K = 2 runs (steps 8+ counted: at M = 1
#                                steps 4-6 run the calibration passes, which
#                                the wall time has and the clocks leave out)
#   STEPS4=30 K4_WARMUP=5        K = 4 runs (the Transformer: 14 and 4)
#   ROUNDS=2                     rounds (every mode once per round)
#   PARTS="fidelity k4"
#   INTERLOCK=build/coordinator/interlock
#   KEEP=DIR                     keep run folders (default: temporary)
set -euo pipefail
cd "$(dirname "$0")/../.."

STEPS=${STEPS:-30}
STEPS4=${STEPS4:-}
ROUNDS=${ROUNDS:-2}
PARTS=${PARTS:-"fidelity k4"}
INTERLOCK=${INTERLOCK:-build/coordinator/interlock}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

if [[ -n "${KEEP:-}" ]]; then
  OUT=$KEEP
  mkdir -p "$OUT"
else
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi

# shellcheck source=tests/bench/bench_lib.sh
source tests/bench/bench_lib.sh  # the working directory is the repository root

date -u +"start %Y-%m-%dT%H:%M:%SZ" | tee "$OUT/when"
: >"$OUT/runs.tsv"
for part in $PARTS; do
  if [[ $part == fidelity ]]; then
    for m in 1 4; do
      cfg=$OUT/resnet_k2_m$m.pbtxt
      sed -e "s/microbatches: 1/microbatches: $m/" \
          -e 's/^  eval_batch_size: 64/  eval_batch_size: 64\n  eval_every_steps: 0/' \
          configs/bench/resnet_k2.pbtxt >"$cfg"
      for r in $(seq 1 "$ROUNDS"); do
        for mode in e2e 1 2; do
          for engine in inprocess cluster; do
            dir=$OUT/fid-m$m-$mode-$engine-r$r
            echo "fidelity M=$m $mode $engine round $r" >&2
            # shellcheck disable=SC2046
            "$INTERLOCK" train --config "$cfg" $(mode_flags "$mode") \
              --engine "$engine" --threads-per-block 1 --schedule sequential \
              --steps "$STEPS" --quiet --out "$dir" >/dev/null
            printf 'fidelity\t%s\t%s\t%s\t%s\t%s\n' "$m" "$mode" "$engine" \
              "$r" "$dir" >>"$OUT/runs.tsv"
            if [[ $engine == inprocess ]]; then
              # shellcheck disable=SC2046
              "$INTERLOCK" simulate --profile "$dir" --blocks 2 \
                $( [[ $mode == e2e ]] && echo "--mode e2e" || echo "--n $mode" ) \
                --microbatches "$m" >"$dir/simulate.txt" 2>&1 || true
            fi
          done
        done
      done
    done
  elif [[ $part == k4 ]]; then
    for name in fmnist_resnet_k4 kjv_transformer_k4; do
      if [[ $name == kjv_transformer_k4 ]]; then
        modes="e2e 1 2sum 3sum" rule=sum steps=${STEPS4:-14}
      else
        modes="e2e 1 2 3" rule=furthest steps=${STEPS4:-30}
      fi
      for r in $(seq 1 "$ROUNDS"); do
        for mode in $modes; do
          dir=$OUT/k4-$name-$mode-r$r
          echo "K=4 $name $mode round $r" >&2
          # shellcheck disable=SC2046
          "$INTERLOCK" train --config "configs/$name.pbtxt" \
            $(mode_flags "$mode") --threads-per-block 1 \
            --schedule sequential --steps "$steps" --quiet --out "$dir" \
            >/dev/null
          "$INTERLOCK" simulate --profile "$dir" --blocks 4 --rule "$rule" \
            >"$dir/simulate.txt" 2>&1 || true
          printf 'k4\t%s\t%s\tinprocess\t%s\t%s\n' "$name" "$mode" "$r" \
            "$dir" >>"$OUT/runs.tsv"
        done
      done
    done
  fi
done
date -u +"end %Y-%m-%dT%H:%M:%SZ" | tee -a "$OUT/when"
python3 tests/bench/virtual_clock_stats.py "$OUT" --fid-warmup "${FID_WARMUP:-8}" \
  ${K4_WARMUP:+--k4-warmup "$K4_WARMUP"}
