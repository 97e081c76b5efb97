#!/usr/bin/env bash
# Step time of a scripted ResNet against the built-in ResNet of the same
# shape ("Your model"; results in docs/BENCHMARKS.md, "Scripted ResNet
# against the built-in one"). A benchmark, not a test.
#
#   bash tests/bench/scripted_vs_builtin.sh [CONFIG]
#
# CONFIG (default configs/fmnist_resnet_k4.pbtxt) must use model.resnet.
#  1. Trains CONFIG one step with a checkpoint and `interlock export`s it.
#  2. Rebuilds the built-in family's units as plain PyTorch modules
#     (interlock.exported.build_modules; the export's architecture and cut,
#     the one-step weights: only speed is measured) and exports them as
#     TorchScript units with interlock.export_model, no user heads.
#  3. Writes copies of CONFIG: "builtin" (as configured), "builtin_nchw"
#     (memory_format CONTIGUOUS, only when CONFIG is CHANNELS_LAST: the
#     built-in family fuses BatchNorm and ReLU only in channels-last) and
#     "scripted" (model { scripted { path } } with CONFIG's partition and head
#     string; data, optimizer, schedule and training unchanged). Every copy
#     caps the test split at MAX_TEST: only the end-of-run evaluation,
#     outside the timed steps, gets shorter.
#  4. Times them in process with `interlock train --steps STEPS --out O`, in
#     the configured mode and in E2E, ROUNDS rounds; in every round and mode
#     the variants run back to back ("a pair"), built-in first in odd rounds,
#     scripted first in even ones. Per run: summary.json's
#     mean_step_seconds.wall (the run leaves step 0 out of it) and, as a
#     check, the mean over steps SKIP.. from metrics.jsonl (after the
#     backward-pass calibration of micro-batches 4-6).
#  5. Prints per-run rows and a table of medians over the rounds and the
#     ratio scripted / built-in (of the medians; and the median of the
#     per-pair ratios).
#
# Before each round it waits (WAIT_STEP s at a time, WAIT_MAX s in all)
# until the 1-minute load average is below QUIET_LOAD, then runs anyway and
# records the load. The load is recorded before every pair.
#
# Settings (environment variables):
#   STEPS=40 ROUNDS=5 SKIP=10 MAX_TEST=500
#   MODES="config e2e"   config = the mode CONFIG sets; e2e, N, Nsum as
#                        tests/bench/bench_lib.sh's mode_flags
#   QUIET_LOAD=1.0 WAIT_STEP=120 WAIT_MAX=2400
#   INTERLOCK=build/coordinator/interlock
#   OMP_NUM_THREADS=1 (also OPENBLAS_ and MKL_NUM_THREADS)
#   KEEP=DIR             keep the work folder (runs, configs, the exported
#                        model) in DIR; default: a temporary one, removed
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/bench/bench_lib.sh

CONFIG=${1:-configs/fmnist_resnet_k4.pbtxt}
STEPS=${STEPS:-40}
ROUNDS=${ROUNDS:-5}
SKIP=${SKIP:-10}
MAX_TEST=${MAX_TEST:-500}
MODES=${MODES:-"config e2e"}
QUIET_LOAD=${QUIET_LOAD:-1.0}
WAIT_STEP=${WAIT_STEP:-120}
WAIT_MAX=${WAIT_MAX:-2400}
CLI=${INTERLOCK:-build/coordinator/interlock}
PY=/usr/bin/python3
# One intra-op thread, as the other step-time benchmarks (the ready configs'
# threads_per_block is 1 too).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}

if [[ ! -f "$CONFIG" ]]; then
  echo "scripted_vs_builtin.sh: no config $CONFIG" >&2
  exit 2
fi
if ((STEPS <= SKIP)); then
  echo "scripted_vs_builtin.sh: STEPS ($STEPS) must exceed SKIP ($SKIP)" >&2
  exit 2
fi
if [[ -n "${KEEP:-}" ]]; then
  WORK=$KEEP
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d /tmp/interlock-svb.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
WORK=$(cd "$WORK" && pwd)

load3() { cut -d' ' -f1-3 /proc/loadavg; }
load1() { cut -d' ' -f1 /proc/loadavg; }
waited=0
wait_quiet() {
  local l
  while :; do
    l=$(load1)
    if awk -v l="$l" -v q="$QUIET_LOAD" 'BEGIN { exit !(l < q) }'; then
      return 0
    fi
    if ((waited >= WAIT_MAX)); then
      echo "# load $l >= $QUIET_LOAD after ${waited} s of waiting: running anyway"
      return 0
    fi
    echo "# load $l >= $QUIET_LOAD: waiting ${WAIT_STEP} s ($(date -u +%H:%M:%S) UTC)"
    sleep "$WAIT_STEP"
    waited=$((waited + WAIT_STEP))
  done
}

# Every run uses one copy of the binary: others may rebuild build/ meanwhile.
cp "$CLI" "$WORK/interlock"
CLI_BUILT=$(date -u -r "$CLI" '+%Y-%m-%d %H:%M UTC')
CLI_SHA=$(sha256sum "$CLI" | cut -c1-12)
CLI_NAME=$CLI
CLI="$WORK/interlock"

echo "# scripted_vs_builtin.sh: $CONFIG, $STEPS steps, $ROUNDS rounds, modes: $MODES"
echo "# machine: $(lscpu | sed -n 's/^Model name: *//p') (family $(lscpu | sed -n 's/^CPU family: *//p') model $(lscpu | sed -n 's/^Model: *//p')), nproc $(env -u OMP_NUM_THREADS nproc); OMP_NUM_THREADS=$OMP_NUM_THREADS"
echo "# commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (working tree has uncommitted changes)'); binary $CLI_NAME built $CLI_BUILT (sha256 $CLI_SHA...)"
echo "# start: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), load $(load3)"

# 1. One step with a checkpoint, exported.
"$CLI" train --quiet --config "$CONFIG" --steps 1 --checkpoint-every 1 \
  --out "$WORK/export_run" >"$WORK/export_run.log" 2>&1 ||
  { cat "$WORK/export_run.log"; exit 1; }
"$CLI" export --run "$WORK/export_run" --to "$WORK/export" \
  >"$WORK/export.log" 2>&1 || { cat "$WORK/export.log"; exit 1; }

# 2 and 3. The units as TorchScript, and the configs.
PYTHONHASHSEED=0 "$PY" - "$CONFIG" "$WORK" "$MAX_TEST" <<'PY'
import os
import re
import sys

import torch

sys.path.insert(0, "python")
from interlock import export_model  # noqa: E402
from interlock.exported import build_modules, read_export, read_pbtxt  # noqa: E402

config_path, work, max_test = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(config_path, encoding="utf-8").read()
config = read_pbtxt(text)
model = config.msg("model")
if not model.has("resnet"):
    sys.exit(f"scripted_vs_builtin.sh: {config_path} is not a model.resnet "
             "config")

export_dir = os.path.join(work, "export")
exp = read_export(export_dir)
network = build_modules(export_dir)[-1]
units = [u for block in network.blocks for u in block]
shape = [int(d) for d in exp.all("input_shape")]
torch.manual_seed(0)
model_dir = os.path.join(work, "model")
result = export_model(units, torch.randn(4, *shape), model_dir)
print(f"# scripted: {len(units)} units "
      f"({', '.join(type(u).__name__ for u in units)}), "
      f"torch.jit {'/'.join(sorted(set(result.methods)))}; cut "
      f"{[int(c) for c in exp.all('partition')]}")


def block_span(text, name):
    """(start, open brace, end) of the top-level message `name { ... }`."""
    depth, found = 0, None
    token = re.compile(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\''
                       r'|[{}]|[A-Za-z_][\w.]*')
    last_word = None
    for m in token.finditer(text):
        t = m.group()
        if t[0] in "#\"'":
            continue
        if t == "{":
            if depth == 0 and last_word and last_word[0] == name:
                found = (last_word[1], m.start())
            depth += 1
        elif t == "}":
            depth -= 1
            if depth == 0 and found:
                return found[0], found[1], m.end()
        elif depth == 0:
            last_word = (t, m.start())
    raise SystemExit(f"scripted_vs_builtin.sh: no top-level '{name} {{ }}' "
                     f"in {config_path}")


def with_max_test(t):
    data = config.msg("data")
    if data.has("max_test") and int(data.get("max_test")) > 0:
        return t
    start, brace, end = block_span(t, "data")
    return t[:brace + 1] + f" max_test: {max_test}" + t[brace + 1:]


def renamed(t, suffix):
    name = config.get("name", "")
    return re.sub(r'^(\s*name\s*:?\s*)"[^"]*"',
                  lambda m: m.group(1) + f'"{name}_{suffix}"', t, count=1,
                  flags=re.M)


base = renamed(with_max_test(text), "builtin")
variants = {"builtin": base}
channels_last = model.msg("resnet").get("memory_format") in ("CHANNELS_LAST",
                                                             2)
if channels_last:
    start, brace, end = block_span(base, "model")
    block = re.sub(r"memory_format\s*:?\s*\w+", "memory_format: CONTIGUOUS",
                   base[start:end])
    variants["builtin_nchw"] = renamed(base[:start] + block + base[end:],
                                       "builtin_nchw")

partition = str(model.get("partition", "") or "")
if partition in ("", "auto"):
    partition = ",".join(str(int(c)) for c in exp.all("partition"))
head = str(model.get("head", "") or "")
scripted_model = ("model {\n"
                  f"  scripted {{ path: \"{model_dir}\" }}\n"
                  f"  partition: \"{partition}\"\n"
                  f"  head: \"{head}\"\n"
                  "}")
start, brace, end = block_span(base, "model")
variants["scripted"] = renamed(base[:start] + scripted_model + base[end:],
                               "scripted")
for name, t in variants.items():
    with open(os.path.join(work, name + ".pbtxt"), "w",
              encoding="utf-8") as f:
        f.write(t)
with open(os.path.join(work, "variants"), "w") as f:
    f.write(" ".join(variants) + "\n")
PY

read -r -a VARIANTS <"$WORK/variants"
echo "# variants: ${VARIANTS[*]} (configs in $WORK)"

mkdir -p "$WORK/runs"
ROWS="$WORK/runs.tsv"
printf "round\tmode\tvariant\tload1_before_pair\tsummary_mean_wall_s\tsteady_wall_s\tcpu_stall_pct\n" >"$ROWS"
echo "round mode variant load1 summary_mean_wall_s steady_wall_s(steps $SKIP+) cpu_stall%"
for r in $(seq "$ROUNDS"); do
  wait_quiet
  if ((r % 2 == 1)); then order=("${VARIANTS[@]}"); else
    order=(scripted)
    for v in "${VARIANTS[@]}"; do [[ $v == scripted ]] || order+=("$v"); done
  fi
  for mode in $MODES; do
    load=$(load1)
    flags=()
    # shellcheck disable=SC2207
    if [[ $mode != config ]]; then flags=($(mode_flags "$mode")); fi
    for v in "${order[@]}"; do
      out="$WORK/runs/r${r}_${mode}_$v"
      rm -rf "$out"
      s0=$(cpu_stall_us)
      t0=$(now_us)
      "$CLI" train --quiet --config "$WORK/$v.pbtxt" "${flags[@]}" \
        --steps "$STEPS" --out "$out" >"$out.log" 2>&1 ||
        { cat "$out.log"; exit 1; }
      t1=$(now_us)
      s1=$(cpu_stall_us)
      "$PY" - "$out" "$SKIP" "$r" "$mode" "$v" "$load" "${s0:-}" "${s1:-}" \
        "$t0" "$t1" "$ROWS" <<'PY'
import json, sys
out, skip, r, mode, v, load, s0, s1, t0, t1, rows = sys.argv[1:]
skip = int(skip)
summary = json.load(open(out + "/summary.json"))
mean = summary["mean_step_seconds"]["wall"]
walls = [json.loads(l)["wall_seconds"] for l in open(out + "/metrics.jsonl")]
steady = (walls[-1] - walls[skip - 1]) / (len(walls) - skip)
stall = (100.0 * (int(s1) - int(s0)) / (int(t1) - int(t0))
         if s0 and s1 else float("nan"))
if mode == "config":
    mode = summary["mode"]
row = [r, mode, v, load, f"{mean:.4f}", f"{steady:.4f}", f"{stall:.0f}"]
print(" ".join(row))
with open(rows, "a") as f:
    f.write("\t".join(row) + "\n")
PY
      rm -rf "$out/checkpoints"
    done
  done
done
echo "# end: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), load $(load3), waited ${waited} s for a quiet machine"

"$PY" - "$ROWS" "$CONFIG" <<'PY'
import collections, csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
config = sys.argv[2]
by = collections.defaultdict(dict)          # (mode, variant) -> round -> row
modes = []
for row in rows:
    if row["mode"] not in modes:
        modes.append(row["mode"])
    by[(row["mode"], row["variant"])][row["round"]] = row
variants = [v for v in ("builtin", "builtin_nchw")
            if any((m, v) in by for m in modes)]


def med(mode, v, key):
    return statistics.median(float(r[key]) for r in by[(mode, v)].values())


for key, what in (("summary_mean_wall_s", "summary.json mean step (wall)"),
                  ("steady_wall_s", "mean step over the steps after calibration")):
    print(f"\n{what}, median of {len(by[(modes[0], 'scripted')])} rounds:\n")
    print("| config | mode | built-in | built-in median step (s) | scripted "
          "median step (s) | scripted / built-in (of medians) | per-pair ratios "
          "(median, range) | load before the pairs |")
    print("|---|---|---|---:|---:|---:|---|---|")
    for mode in modes:
        s = med(mode, "scripted", key)
        for v in variants:
            b = med(mode, v, key)
            ratios = sorted(float(by[(mode, "scripted")][r][key]) /
                            float(row[key]) for r, row in by[(mode, v)].items())
            loads = [float(row["load1_before_pair"])
                     for row in by[(mode, v)].values()]
            label = ("as configured" if v == "builtin"
                     else "memory_format CONTIGUOUS")
            print(f"| {config} | {mode} | {label} | {b:.4f} | {s:.4f} | "
                  f"{s / b:.2f} | {statistics.median(ratios):.2f} "
                  f"({ratios[0]:.2f}–{ratios[-1]:.2f}) | "
                  f"{min(loads):.2f}–{max(loads):.2f} |")
PY
