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
# 2. The paper's headline on the virtual clock: configs/kjv_transformer_k4
#    (K = 4), in process, one thread, modes E2E, 1-way, 2-way SUM, 2-way
#    FURTHEST, 3-way SUM; step time on the virtual clock and its ratio to E2E.
#
# Settings (environment variables):
#   STEPS=30 FID_WARMUP=5        fidelity runs
#   HSTEPS=14 HEAD_WARMUP=4      headline runs
#   ROUNDS=2                     rounds (every mode once per round)
#   PARTS="fidelity headline"
#   INTERLOCK=build/coordinator/interlock
#   KEEP=DIR                     keep run folders (default: temporary)
set -euo pipefail
cd "$(dirname "$0")/../.."

STEPS=${STEPS:-30}
HSTEPS=${HSTEPS:-14}
ROUNDS=${ROUNDS:-2}
PARTS=${PARTS:-"fidelity headline"}
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
  else
    for r in $(seq 1 "$ROUNDS"); do
      for mode in e2e 1 2sum 2 3sum; do
        dir=$OUT/head-$mode-r$r
        echo "headline $mode round $r" >&2
        # shellcheck disable=SC2046
        "$INTERLOCK" train --config configs/kjv_transformer_k4.pbtxt \
          $(mode_flags "$mode") --threads-per-block 1 --schedule sequential \
          --steps "$HSTEPS" --quiet --out "$dir" >/dev/null
        printf 'headline\t4\t%s\tinprocess\t%s\t%s\n' "$mode" "$r" "$dir" \
          >>"$OUT/runs.tsv"
      done
    done
  fi
done
date -u +"end %Y-%m-%dT%H:%M:%SZ" | tee -a "$OUT/when"
python3 tests/bench/virtual_clock_stats.py "$OUT" --fid-warmup "${FID_WARMUP:-5}" \
  --head-warmup "${HEAD_WARMUP:-4}"
