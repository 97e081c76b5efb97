#!/usr/bin/env bash
# The ready scripted config (configs/scripted_cnn_k3.pbtxt) as a user runs
# it: export the model with the Python package, then train it in process
# and on a local cluster of worker processes. The two must end with the
# same digest (bitwise equal parameters) in E2E, 2-way FURTHEST and 2-way
# SUM, with block replicas and with a compressed wire.
# Usage: scripted_config_test.sh SOURCE_DIR INTERLOCK_CLI
set -euo pipefail
SRC="$1"
CLI="$2"
WORK="$(mktemp -d /tmp/interlock-scripted-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
/usr/bin/python3 "$SRC/python/examples/export_small_cnn.py" models/small_cnn >/dev/null
fail=0
# The last two: block 0 on two ORDERED replicas, and BF16 on the wire; both
# equal in process (which applies the same codec at every boundary).
for mode in "--mode e2e" "--n 2 --rule furthest" "--n 2 --rule sum" \
  "--n 2 --replicas 2,1,1" "--n 2 --wire bf16"; do
  digests=()
  for engine in inprocess cluster; do
    # shellcheck disable=SC2086
    out="$("$CLI" train --config "$SRC/configs/scripted_cnn_k3.pbtxt" \
      --steps 4 $mode --engine "$engine" 2>&1)" || {
      echo "scripted: $mode on $engine failed:"; echo "$out"; exit 1; }
    d="$(grep -o 'digest [0-9a-f]*' <<<"$out" | tail -1)"
    [[ -n "$d" ]] || { echo "scripted: no digest from $mode on $engine"; echo "$out"; exit 1; }
    digests+=("$d")
  done
  if [[ "${digests[0]}" != "${digests[1]}" ]]; then
    echo "scripted: $mode: in process ${digests[0]} != cluster ${digests[1]}"
    fail=1
  else
    echo "scripted: $mode: in process == cluster (${digests[0]})"
  fi
done
exit "$fail"
