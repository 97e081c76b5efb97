#!/bin/bash
# The wire benchmark (interlock_wire_bench) over a link of a given rate, the
# case the compressed codecs are for (issue 13): raw TCP and the worker
# stream with each codec, side by side in one process as on plain loopback,
# but in a network namespace of its own whose loopback is shaped by a token
# bucket (tc tbf). Nothing outside the namespace sees the shaping. Needs root
# (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.
#
#   bash tests/bench/wire_link.sh RATE [BENCH FLAGS...]
#   e.g. bash tests/bench/wire_link.sh 1gbit --rounds 5 --exchanges 2
# (env: BUILD; BURST, the bucket's size, default 1mb)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BURST=${BURST:-1mb}
if (($# < 1)); then
  echo "usage: $0 RATE [interlock_wire_bench flags]" >&2
  exit 2
fi
RATE=$1
shift
BENCH=$BUILD/tests/bench/interlock_wire_bench
[[ -x $BENCH ]] || { echo "wire_link.sh: no $BENCH (make build)" >&2; exit 2; }
command -v tc > /dev/null || { echo "wire_link.sh: needs tc (iproute2)" >&2; exit 2; }

echo "wire_link.sh: loopback shaped to $RATE (tbf, burst $BURST);" \
  "$(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
# The shaping lives and dies with the namespace.
exec unshare --net bash -c '
  set -euo pipefail
  ip link set lo up
  tc qdisc add dev lo root tbf rate "$1" burst "$2" latency 100ms
  bench=$3
  shift 3
  "$bench" "$@"
' wire_link "$RATE" "$BURST" "$BENCH" "$@"
