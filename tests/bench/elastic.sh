#!/bin/bash
# Membership timings on a real config (issue 12): a replica of block 1
# joins, a replica of block 0 is killed (kill -9; FAIL=STOP: stopped, so it
# hangs with its sockets open and only keepalive notices), the joined one
# leaves on SIGTERM, in one cluster run started as 2,1,1,1 with ORDERED
# reduction.
# Per repeat it prints
#   join:     worker launched -> serving (its port file written), ->
#             "registered as" (Register answered)
#             launched -> the coordinator's "topology changed" log line, i.e.
#             the joiner configured, loaded and given the next step's traffic
#   failure:  kill -9 (or SIGSTOP) -> the first step recorded after the
#             fail-over
#   leave:    SIGTERM -> the worker's exit
#   and the coordinator's own drain/change split for each change.
# Times are polled every 20 ms, so each is an upper bound by about that.
#
#   bash tests/bench/elastic.sh [REPEATS]
#   (env: BUILD, CONFIG, STEPS, M, FAIL = KILL or STOP, KILL_AFTER = steps
#   recorded between the join and the kill (5), EXTRA = more
#   `interlock train` flags such as "--window 8": the drain before a change
#   waits for every micro-batch in flight, 2 x K x M by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/bench/bench_lib.sh
BUILD=${BUILD:-build}
CONFIG=${CONFIG:-configs/fmnist_resnet_k4.pbtxt}
STEPS=${STEPS:-60}
M=${M:-4}  # a block takes at most one replica per micro-batch
FAIL=${FAIL:-KILL}
KILL_AFTER=${KILL_AFTER:-5}  # metrics.jsonl lines after the join
REPEATS=${1:-3}
CLI=$BUILD/coordinator/interlock
WORKER=$BUILD/worker/interlock-worker

secs() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(secs)" 'BEGIN { printf "%.2f", b - a }'; }
lines() { if [[ -f $1 ]]; then wc -l <"$1"; else echo 0; fi; }
# wait_until CMD...: polls every 20 ms, gives up after 300 s.
wait_until() {
  local deadline=$((SECONDS + 300))
  until "$@"; do
    ((SECONDS < deadline)) || { echo "timed out: $*" >&2; return 1; }
    if [[ -n ${cli:-} ]] && ! kill -0 "$cli" 2>/dev/null; then
      echo "the run ended early:" >&2
      tail -5 "$dir/cli.log" >&2
      return 1
    fi
    sleep 0.02
  done
}
has() { grep -q "$2" "$1" 2>/dev/null; }
at_least() { (($(lines "$1") >= $2)); }

start_worker() {  # DIR I [FLAGS...]
  local dir=$1 i=$2
  shift 2
  "$WORKER" --host 127.0.0.1 --port 0 --port_file "$dir/w$i.port" \
    --metrics_port 0 "$@" >"$dir/w$i.log" 2>&1 &
  echo $! >"$dir/w$i.pid"
  wait_until test -s "$dir/w$i.port"
}
addr() { echo "127.0.0.1:$(cat "$1/w$2.port")"; }

echo "elastic.sh: $CONFIG, M=$M, $STEPS steps, 2,1,1,1, SIG$FAIL ${EXTRA:-};" \
  "$(nproc) cores," \
  "load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$REPEATS"); do
  cli=
  dir=$(mktemp -d /tmp/interlock-elastic.XXXXXX)
  # The config with M micro-batches (a block takes at most one replica per
  # micro-batch); the joiner names the same file, so its fingerprint matches.
  sed "s/^\( *microbatches:\).*/\1 $M/" "$CONFIG" >"$dir/config.pbtxt"
  grep -q "microbatches: $M" "$dir/config.pbtxt" ||
    { echo "no training.microbatches line in $CONFIG" >&2; exit 2; }
  for i in 0 1 2 3 4; do start_worker "$dir" "$i"; done
  workers="$(addr "$dir" 0)+$(addr "$dir" 1),$(addr "$dir" 2),$(addr "$dir" 3),$(addr "$dir" 4)"
  out=$dir/out
  "$CLI" train --config "$dir/config.pbtxt" --engine cluster \
    --workers "$workers" ${EXTRA:-} --steps "$STEPS" --coordinator_port 0 \
    --coordinator_host 127.0.0.1 --coordinator_port_file "$dir/port" \
    --out "$out" --quiet >"$dir/cli.log" 2>&1 &
  cli=$!
  wait_until test -s "$dir/port"
  m=$out/metrics.jsonl

  wait_until at_least "$m" 5
  t=$(secs)
  start_worker "$dir" 5 --coordinator "127.0.0.1:$(cat "$dir/port")" \
    --block 1 --run_config "$dir/config.pbtxt"
  serving=$(since "$t")
  wait_until has "$dir/w5.log" "registered as"
  registered=$(since "$t")
  wait_until has "$dir/cli.log" "topology changed"
  joined=$(since "$t")

  n=$(($(lines "$m") + KILL_AFTER))
  wait_until at_least "$m" "$n"
  t=$(secs)
  kill -"$FAIL" "$(cat "$dir/w1.pid")"
  wait_until has "$dir/cli.log" "surviving replicas continue"
  n=$(lines "$m")
  wait_until at_least "$m" $((n + 1))
  failed=$(since "$t")

  n=$(($(lines "$m") + 5))
  wait_until at_least "$m" "$n"
  t=$(secs)
  kill -TERM "$(cat "$dir/w5.pid")"
  while kill -0 "$(cat "$dir/w5.pid")" 2>/dev/null; do sleep 0.02; done
  left=$(since "$t")

  wait "$cli" || { echo "run failed:"; tail -5 "$dir/cli.log"; exit 1; }
  kill -9 "$(cat "$dir/w1.pid")" 2>/dev/null || true  # if only stopped
  for i in 0 2 3 4; do kill "$(cat "$dir/w$i.pid")" 2>/dev/null || true; done
  { wait; } 2>/dev/null || true  # also the shell's "Killed" notice
  step=$(python3 -c "
import json, statistics
w = [json.loads(l)['wall_seconds'] for l in open('$m')]
d = [b - a for a, b in zip(w, w[1:])]
print('%.3f' % statistics.median(d))")
  echo "repeat $r: join: serving ${serving} s, registered ${registered} s," \
    "in the topology ${joined} s;" \
    "failure to next step ${failed} s; leave ${left} s; median step ${step} s"
  grep "topology changed" "$dir/cli.log" | sed 's/^/  /'
  # What the fail-over ran again: micro-batches the coordinator had seen
  # complete in the steps it replayed.
  python3 -c "
import json
a = json.load(open('$out/summary.json'))['accounting']
print('  failovers %d, recoveries %d, micro-batches replayed %d' % (
    a['failovers'], a['recoveries'], a['microbatches_replayed']))"
  grep -o "continue from step [0-9]*" "$dir/cli.log" | sed 's/^/  /' || true
  [[ -n ${KEEP:-} ]] && echo "  kept $dir" || rm -rf "$dir"
done
