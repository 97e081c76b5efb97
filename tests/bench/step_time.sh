#!/usr/bin/env bash
# In-process step-time benchmark (issue "Foundation"; results in
# docs/BENCHMARKS.md). A benchmark, not a test: it is not part of ctest.
#
# For every config and mode it runs
#   interlock train --config C <mode flags> --threads-per-block T
#       --schedule sequential --quiet --steps N --out DIR
# with OMP_NUM_THREADS=T OPENBLAS_NUM_THREADS=T, in ROUNDS rounds that each run
# every (config, mode) once, rotating the mode order from round to round, so
# that noise from other users of the machine falls on all modes alike. It then
# prints Markdown tables of the median step time (tests/bench/step_time_stats.py).
#
# Settings (environment variables):
#   STEPS=25     optimizer steps per run
#   ROUNDS=3     rounds
#   WARMUP=5     leading steps of every run left out of the statistics
#   THREADS=1    LibTorch intra-op threads per block
#   MODES="e2e 1 2 2sum 3 4"   e2e, n (FURTHEST rule) or nsum (SUM rule)
#   CONFIGS="fmnist ref"       fmnist = configs/fmnist_resnet_k4.pbtxt,
#                              ref = configs/bench/resnet_ref_k4.pbtxt, or paths
#   ALLOC=default  malloc as the binary sets it up. Since commit a2e8631 the
#                binaries' main() keeps freed memory in the heap themselves
#                (mallopt: mmap threshold 32 MiB, trim threshold 1 GiB; see
#                docs/BENCHMARKS.md). ALLOC=tuned also exports GLIBC_TUNABLES
#                with both thresholds at 4 GiB; with the current binaries the
#                mallopt calls override it, so it only matters for binaries
#                built before that commit (the "d177b28 + GLIBC_TUNABLES" rows
#                in the doc).
#   INTERLOCK=build/coordinator/interlock
#   BINARIES="before=PATH after=PATH"   several binaries side by side: every
#                (config, mode) runs each of them in every round, their order
#                alternating from round to round; the tables name the config
#                as CONFIG@LABEL. Overrides INTERLOCK.
#   KEEP=DIR     keep the run folders and runs.tsv in DIR (default: a temporary
#                folder, removed at the end)
#
# The FASHION_MNIST config is run from a copy with `max_test: 500` added to its
# data section: only the end-of-run evaluation shrinks (from 10,000 test images),
# which is outside the timed steps; training and the model are unchanged.
set -euo pipefail

cd "$(dirname "$0")/../.."

STEPS=${STEPS:-25}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-5}
THREADS=${THREADS:-1}
MODES=${MODES:-"e2e 1 2 2sum 3 4"}
CONFIGS=${CONFIGS:-"fmnist ref"}
INTERLOCK=${INTERLOCK:-build/coordinator/interlock}
ALLOC=${ALLOC:-default}
case $ALLOC in
  default) ;;
  tuned)
    export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296
    ;;
  *)
    echo "step_time.sh: ALLOC=$ALLOC, expected default or tuned" >&2
    exit 2
    ;;
esac

# label=path pairs; one unlabelled binary by default.
read -r -a binary_list <<<"${BINARIES:-=$INTERLOCK}"
labels=()
paths=()
for b in "${binary_list[@]}"; do
  labels+=("${b%%=*}")
  paths+=("${b#*=}")
  if [[ ! -x "${b#*=}" ]]; then
    echo "step_time.sh: ${b#*=} not found; run 'make build' first" >&2
    exit 2
  fi
done
nlabels=${#labels[@]}
if (( STEPS < WARMUP + 1 )); then
  echo "step_time.sh: STEPS=$STEPS leaves no timed steps after WARMUP=$WARMUP" >&2
  exit 2
fi

if [[ -n "${KEEP:-}" ]]; then
  work=$KEEP
  mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/interlock-bench.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
: >"$work/runs.tsv"

# Resolve config names to files; the FASHION_MNIST one gets a smaller test set.
declare -A config_file config_name
for c in $CONFIGS; do
  case $c in
    fmnist)
      f="$work/fmnist_resnet_k4.pbtxt"
      sed 's/data { kind: FASHION_MNIST }/data { kind: FASHION_MNIST max_test: 500 }/' \
        configs/fmnist_resnet_k4.pbtxt >"$f"
      if ! grep -q 'max_test: 500' "$f"; then
        cp configs/fmnist_resnet_k4.pbtxt "$f"  # Layout changed: run as is.
      fi
      config_file[$c]=$f
      config_name[$c]=fmnist_resnet_k4
      ;;
    ref)
      config_file[$c]=configs/bench/resnet_ref_k4.pbtxt
      config_name[$c]=resnet_ref_k4
      ;;
    *)
      config_file[$c]=$c
      config_name[$c]=$(basename "$c" .pbtxt)
      ;;
  esac
done

# shellcheck source=tests/bench/bench_lib.sh
source tests/bench/bench_lib.sh  # the working directory is the repository root


export OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS

read -r -a mode_list <<<"$MODES"
nmodes=${#mode_list[@]}
echo "step_time.sh: $ROUNDS rounds x configs [$CONFIGS] x modes [$MODES]," \
  "$STEPS steps each, $THREADS thread(s), $ALLOC allocator" >&2
for ((r = 0; r < ROUNDS; r++)); do
  for c in $CONFIGS; do
    for ((i = 0; i < nmodes; i++)); do
    for ((j = 0; j < nlabels; j++)); do
      mode=${mode_list[$(((i + r) % nmodes))]}
      label=${labels[$(((j + r) % nlabels))]}
      binary=${paths[$(((j + r) % nlabels))]}
      name=${config_name[$c]}${label:+@$label}
      dir="$work/$name.$mode.r$r"
      timer=()
      if [[ -x /usr/bin/time ]]; then
        timer=(/usr/bin/time -o "$dir.time" -f '%R %U %S')
      fi
      # shellcheck disable=SC2046
      set -- $(mode_flags "$mode")
      stall0=$(cpu_stall_us)
      t0=$(now_us)
      if ! "${timer[@]}" "$binary" train --config "${config_file[$c]}" "$@" \
          --threads-per-block "$THREADS" --schedule sequential --quiet \
          --steps "$STEPS" --out "$dir" >"$dir.log" 2>&1; then
        echo "step_time.sh: run failed: $name $mode (log below)" >&2
        cat "$dir.log" >&2
        exit 1
      fi
      t1=$(now_us)
      stall1=$(cpu_stall_us)
      stall=""
      if [[ -n "$stall0" && -n "$stall1" ]]; then stall=$((stall1 - stall0)); fi
      usage=""  # minor page faults, user s, system s
      if [[ -s "$dir.time" ]]; then usage=$(tail -n 1 "$dir.time"); fi
      printf '%s\t%s\t%d\t%s\t%s\t%d\t%s\n' "$name" "$mode" \
        "$r" "$dir" "$stall" "$((t1 - t0))" "$usage" >>"$work/runs.tsv"
      echo "  round $((r + 1))/$ROUNDS $name $mode:" \
        "$(((t1 - t0) / 1000)) ms" >&2
    done
    done
  done
done

echo
echo "Median step time, batch from the config, $THREADS thread(s)," \
  "sequential schedule, $ALLOC allocator, $ROUNDS rounds x $STEPS steps" \
  "(first $WARMUP dropped)."
echo
python3 tests/bench/step_time_stats.py --warmup "$WARMUP" "$work"
