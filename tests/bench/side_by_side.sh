#!/usr/bin/env bash
# Side by side with a plain PyTorch script (issue 15; docs/BENCHMARKS.md,
# "Side by side with a PyTorch script"). A benchmark, not a test: it is not
# part of ctest or `make test`.
#
# For every mode it runs, in ROUNDS rounds,
#   interlock train --config CONFIG <mode flags> --schedule threaded
#       --threads-per-block 1 --steps S --quiet --out DIR
#   python3 tests/bench/python_ref/interlock_ref.py --config CONFIG
#       --mode MODE --steps S --out DIR
# both with OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1, each
# twice in a row: S = WARMUP and S = STEPS. The time per step is
#   (wall_seconds of the last step of the long run
#    - wall_seconds of the last step of the short run) / (STEPS - WARMUP),
# the steady-state time of steps WARMUP..STEPS-1; start-up, the warm-up steps
# and the pipeline's drain at the end are in both runs and cancel. (The last
# step's wall_seconds is exact in both implementations because the run waits
# for it; the per-step differences step_time.sh uses are not in Interlock's
# 1-way threaded runs, whose completions reach the coordinator in bursts, see
# docs/BENCHMARKS.md.) The mode order rotates from round to round and which
# of the two implementations goes first alternates, so that noise from other
# users of the machine falls on both alike. It then prints a Markdown table of
# the median over rounds per mode and the ratio Interlock / Python
# (tests/bench/side_by_side_stats.py), and the roofline line
# (tests/bench/python_ref/roofline.py): one core's measured matmul and
# convolution GFLOP/s, the FLOPs of one step per mode counted from the model,
# and what each implementation achieves.
#
# Debian's python3-torch and python3-torchvision are installed with apt-get
# when PYTHON cannot import them (root, or sudo).
#
# Settings (environment variables):
#   STEPS=30     optimizer steps of the long run
#   ROUNDS=3     rounds
#   WARMUP=8     optimizer steps of the short run (left out of the timing):
#                at one micro-batch per step they hold the micro-batches
#                4-6 at which each block times its three kinds of backward
#                pass once for the virtual clock (services/calibration.h),
#                a start-up cost the Python script does not have
#   MODES="e2e 1 2 3"   e2e, n (FURTHEST rule) or nsum (SUM rule)
#   CONFIG=configs/bench/resnet_ref_k4.pbtxt
#   INTERLOCK=build/coordinator/interlock
#   PYTHON=/usr/bin/python3   Debian's Python (python3-torch is built for it)
#   PY_ALLOC=default  glibc malloc as a plain Python process has it. tuned:
#                the Python runs get GLIBC_TUNABLES with the settings our
#                binaries' main() makes with mallopt (services/runtime.cc), to
#                see how much of a difference is the allocator alone
#   PY_FORMAT=contiguous  the Python runs' memory format: contiguous (NCHW,
#                as a plain script has it) or channels_last (the script's
#                --memory-format; what our config's model.resnet.memory_format
#                CHANNELS_LAST does in Interlock)
#   ROOFLINE_SECONDS=3   time per throughput measurement (0: no roofline)
#   KEEP=DIR     keep the run folders and runs.tsv in DIR (default: a temporary
#                folder, removed at the end)
set -euo pipefail

cd "$(dirname "$0")/../.."

STEPS=${STEPS:-30}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-8}
MODES=${MODES:-"e2e 1 2 3"}
CONFIG=${CONFIG:-configs/bench/resnet_ref_k4.pbtxt}
INTERLOCK=${INTERLOCK:-build/coordinator/interlock}
PYTHON=${PYTHON:-/usr/bin/python3}
ROOFLINE_SECONDS=${ROOFLINE_SECONDS:-3}
PY_ALLOC=${PY_ALLOC:-default}
PY_FORMAT=${PY_FORMAT:-contiguous}
py_env=()
case $PY_ALLOC in
  default) ;;
  tuned)
    py_env=(GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1)
    ;;
  *)
    echo "side_by_side.sh: PY_ALLOC=$PY_ALLOC, expected default or tuned" >&2
    exit 2
    ;;
esac

if [[ ! -x "$INTERLOCK" ]]; then
  echo "side_by_side.sh: $INTERLOCK not found; run 'make build' first" >&2
  exit 2
fi
if (( WARMUP < 1 || STEPS < WARMUP + 1 )); then
  echo "side_by_side.sh: STEPS=$STEPS leaves no timed steps after WARMUP=$WARMUP" >&2
  exit 2
fi

if ! "$PYTHON" -c 'import torch, torchvision' 2>/dev/null; then
  echo "side_by_side.sh: installing python3-torch python3-torchvision" >&2
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  pkgs=(python3-torch python3-torchvision)
  if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${pkgs[@]}"; then
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${pkgs[@]}"
  fi
  "$PYTHON" -c 'import torch, torchvision'
fi

if [[ -n "${KEEP:-}" ]]; then
  work=$KEEP
  mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/interlock-side-by-side.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
: >"$work/runs.tsv"

# shellcheck source=tests/bench/bench_lib.sh
source tests/bench/bench_lib.sh  # the working directory is the repository root


load() {
  local psi=""
  if [[ -r /proc/pressure/cpu ]]; then
    psi="; /proc/pressure/cpu: $(head -n 1 /proc/pressure/cpu)"
  fi
  echo "load average $(cut -d' ' -f1-3 /proc/loadavg)$psi"
}

# One run of one implementation; appends a line to runs.tsv.
run_one() {  # impl mode round steps
  local impl=$1 mode=$2 r=$3 steps=$4
  local dir="$work/$impl.$mode.r$r.s$steps"
  local cmd flags
  if [[ $impl == interlock ]]; then
    read -r -a flags <<<"$(mode_flags "$mode")"
    cmd=("$INTERLOCK" train --config "$CONFIG" "${flags[@]}"
         --schedule threaded --threads-per-block 1 --quiet
         --steps "$steps" --out "$dir")
  else
    cmd=(env "${py_env[@]}" "$PYTHON" tests/bench/python_ref/interlock_ref.py
         --config "$CONFIG"
         --mode "$mode" --steps "$steps" --out "$dir"
         --memory-format "$PY_FORMAT")
  fi
  local stall0 stall1 t0 t1 stall=""
  stall0=$(cpu_stall_us)
  t0=$(now_us)
  if ! "${cmd[@]}" >"$dir.log" 2>&1; then
    echo "side_by_side.sh: run failed: $impl $mode (log below)" >&2
    cat "$dir.log" >&2
    exit 1
  fi
  t1=$(now_us)
  stall1=$(cpu_stall_us)
  if [[ -n "$stall0" && -n "$stall1" ]]; then stall=$((stall1 - stall0)); fi
  printf '%s\t%s\t%d\t%d\t%s\t%s\t%d\n' "$impl" "$mode" "$r" "$steps" \
    "$dir" "$stall" "$((t1 - t0))" >>"$work/runs.tsv"
  echo "  round $((r + 1))/$ROUNDS $impl $mode, $steps steps:" \
    "$(((t1 - t0) / 1000)) ms" >&2
}

run_pair() {  # impl mode round
  run_one "$1" "$2" "$3" "$WARMUP"
  run_one "$1" "$2" "$3" "$STEPS"
}

export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
load_before=$(load)
read -r -a mode_list <<<"$MODES"
nmodes=${#mode_list[@]}
echo "side_by_side.sh: $ROUNDS rounds x modes [$MODES] x {python, interlock}" \
  "x {$WARMUP, $STEPS} steps" >&2
for ((r = 0; r < ROUNDS; r++)); do
  for ((i = 0; i < nmodes; i++)); do
    mode=${mode_list[$(((i + r) % nmodes))]}
    if (( (r + i) % 2 == 0 )); then
      run_pair python "$mode" "$r"
      run_pair interlock "$mode" "$r"
    else
      run_pair interlock "$mode" "$r"
      run_pair python "$mode" "$r"
    fi
  done
done
load_after=$(load)

echo
echo "Side by side, $CONFIG, one intra-op thread per block, blocks on their"
echo "own threads (interlock --schedule threaded; Python: one thread per block),"
echo "$ROUNDS rounds x ($STEPS - $WARMUP) steps timed, $(date -u '+%Y-%m-%d %H:%M UTC')."
echo "Machine: $cpu, $(env -u OMP_NUM_THREADS nproc) cores; Linux $(uname -r)."
echo "Interlock: $INTERLOCK (built $(date -u -r "$INTERLOCK" '+%Y-%m-%d %H:%M UTC'));" \
  "scripts at $(git rev-parse --short HEAD 2>/dev/null || echo '?');" \
  "Python $("$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], "with torch", torch.__version__)')," \
  "$PY_ALLOC malloc, $PY_FORMAT memory format;" \
  "config's model.resnet.memory_format:" \
  "$(sed -n 's/.*memory_format: *\([A-Z_]*\).*/\1/p' "$CONFIG" | head -n 1 | grep . || echo CONTIGUOUS)."
echo "Before: $load_before"
echo "After:  $load_after"
echo
"$PYTHON" tests/bench/side_by_side_stats.py "$work"

if [[ $ROOFLINE_SECONDS != 0 ]]; then
  echo
  echo "Roofline ($(load)):"
  echo
  "$PYTHON" tests/bench/python_ref/roofline.py --config "$CONFIG" \
    --modes "$MODES" --times "$work/medians.tsv" --seconds "$ROOFLINE_SECONDS"
fi
