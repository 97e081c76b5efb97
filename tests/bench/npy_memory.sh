#!/usr/bin/env bash
# Memory-mapped NPY data (DataSpec NPY) against the process's memory and the
# step time. A benchmark, not a test: it is not part of ctest.
#
# Writes a .npy set of SIZE_GB gigabytes (train_x.npy: float32 [N, FEATURES]
# of random normals; train_y.npy: int64 [N] of CLASSES classes; a small test
# split), then trains STEPS steps of an MLP on it with
#   interlock train --schedule sequential --quiet --steps STEPS --out DIR
# while sampling /proc/PID/status every 50 ms, and does the same with the same
# model on SYNTHETIC_VECTORS data of the same sample shape (SYNTH_N samples,
# held in memory). It prints, for both runs, the peak RssAnon (anonymous
# memory: what a copy of the data would take), the peak RssFile (mapped file
# pages, the page cache's) and the median step time after WARMUP steps.
#
# Settings (environment variables):
#   SIZE_GB=3        size of train_x.npy in GB (10^9 bytes); fractions work
#   FEATURES=1024    floats per sample
#   CLASSES=10
#   STEPS=60 WARMUP=10 BATCH=256 HIDDEN="256, 256"
#   SYNTH_N=16384    training samples of the SYNTHETIC_VECTORS run
#   DIR=             where the set is written (default: a temporary folder
#                    under TMPDIR, removed at the end unless KEEP=1)
#   COLD=0           1: drop the page cache before the NPY run (root only),
#                    so that batches are read from the disk
#   INTERLOCK=build/coordinator/interlock
set -euo pipefail

cd "$(dirname "$0")/../.."

SIZE_GB=${SIZE_GB:-3}
FEATURES=${FEATURES:-1024}
CLASSES=${CLASSES:-10}
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-10}
BATCH=${BATCH:-256}
HIDDEN=${HIDDEN:-"256, 256"}
SYNTH_N=${SYNTH_N:-16384}
COLD=${COLD:-0}
KEEP=${KEEP:-0}
INTERLOCK=${INTERLOCK:-build/coordinator/interlock}
PYTHON=/usr/bin/python3

if [[ ! -x "$INTERLOCK" ]]; then
  echo "npy_memory.sh: $INTERLOCK not built (ninja -C build interlock)" >&2
  exit 2
fi

OWN_DIR=0
if [[ -z "${DIR:-}" ]]; then
  DIR="$(mktemp -d "${TMPDIR:-/tmp}/npy_memory_XXXXXX")"
  OWN_DIR=1
fi
mkdir -p "$DIR"
cleanup() {
  if ((OWN_DIR)) && [[ "$KEEP" != 1 ]]; then rm -rf "$DIR"; fi
}
trap cleanup EXIT

# ---- The set, written in chunks through numpy's own memory map.
echo "npy_memory: writing ${SIZE_GB} GB of float32 x ${FEATURES} to $DIR"
t0=$(date +%s.%N)
"$PYTHON" - "$DIR" "$SIZE_GB" "$FEATURES" "$CLASSES" <<'PY'
import sys
import numpy as np
from numpy.lib.format import open_memmap

d, size_gb, f, classes = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
n = int(size_gb * 1e9) // (4 * f)
rng = np.random.default_rng(0)
x = open_memmap(d + "/train_x.npy", mode="w+", dtype=np.float32, shape=(n, f))
y = rng.integers(0, classes, n)
chunk = max(1, (64 << 20) // (4 * f))
for i in range(0, n, chunk):
    m = min(chunk, n - i)
    x[i:i + m] = rng.standard_normal((m, f), dtype=np.float32)
    x[i:i + m, 0] += y[i:i + m]  # something to learn
x.flush()
del x
np.save(d + "/train_y.npy", y)
t = rng.integers(0, classes, 1024)
tx = rng.standard_normal((1024, f), dtype=np.float32)
tx[:, 0] += t
np.save(d + "/test_x.npy", tx)
np.save(d + "/test_y.npy", t)
print(n)
PY
t1=$(date +%s.%N)
FILE_BYTES=$(stat -c %s "$DIR/train_x.npy")
echo "npy_memory: train_x.npy $FILE_BYTES bytes in $(awk "BEGIN {printf \"%.1f\", $t1 - $t0}") s"

config() {  # config DATA_SECTION
  cat <<EOF
name: "npy_memory"
model {
  mlp { hidden: [ $HIDDEN ] }
  blocks: 3
  head: "fc"
}
data { $1 max_test: 1024 }
optimizer { kind: SGD momentum: 0.9 }
schedule { kind: CONSTANT lr: 0.01 }
training { mode: INTERLOCK n: 2 batch_size: $BATCH steps: $STEPS seed: 1 }
EOF
}

# run NAME DATA_SECTION: trains, samples the process; prints the peak
# RssAnon and RssFile (kB) into $DIR/NAME.mem.
run() {
  local name=$1 out="$DIR/run_$1"
  rm -rf "$out"
  config "$2" >"$DIR/$name.pbtxt"
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$INTERLOCK" train \
    --config "$DIR/$name.pbtxt" --schedule sequential --quiet \
    --steps "$STEPS" --out "$out" >"$DIR/$name.log" 2>&1 &
  local pid=$! anon=0 file=0 a f
  while kill -0 "$pid" 2>/dev/null; do
    if read -r a f < <(awk '/^RssAnon:/ {a = $2} /^RssFile:/ {f = $2}
        END {print a + 0, f + 0}' "/proc/$pid/status" 2>/dev/null); then
      ((a > anon)) && anon=$a
      ((f > file)) && file=$f
    fi
    sleep 0.05
  done
  if ! wait "$pid"; then
    echo "npy_memory: the $name run failed:" >&2
    tail -n 20 "$DIR/$name.log" >&2
    exit 1
  fi
  echo "$anon $file" >"$DIR/$name.mem"
}

if [[ "$COLD" == 1 ]]; then
  sync
  echo 3 >/proc/sys/vm/drop_caches
fi
run npy "kind: NPY path: \"$DIR\""
run synthetic "kind: SYNTHETIC_VECTORS synthetic_shape: $FEATURES synthetic_classes: $CLASSES synthetic_train: $SYNTH_N synthetic_test: 1024"

"$PYTHON" - "$DIR" "$FILE_BYTES" "$WARMUP" "$FEATURES" "$SYNTH_N" <<'PY'
import json
import statistics
import sys

d, file_bytes, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
features, synth_n = int(sys.argv[4]), int(sys.argv[5])


def step_ms(name):
    walls = [json.loads(line)["wall_seconds"]
             for line in open("%s/run_%s/metrics.jsonl" % (d, name))]
    steps = [b - a for a, b in zip(walls, walls[1:])][warmup:]
    return 1000 * statistics.median(steps), len(steps)


mib = 1 << 20
print()
print("| data | data size | peak RssAnon | peak RssFile | median step (ms) | steps |")
print("|---|---:|---:|---:|---:|---:|")
for name, size in (("npy", file_bytes), ("synthetic", 4 * features * synth_n)):
    anon, mapped = (int(v) * 1024 for v in open("%s/%s.mem" % (d, name)).read().split())
    ms, n = step_ms(name)
    label = "NPY (mapped)" if name == "npy" else "SYNTHETIC_VECTORS (in memory)"
    print("| %s | %.0f MiB | %.0f MiB | %.0f MiB | %.2f | %d |"
          % (label, size / mib, anon / mib, mapped / mib, ms, n))
PY
