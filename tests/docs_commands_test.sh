#!/usr/bin/env bash
# Every command README.md shows in a ```sh block runs here, in order, with
# short budgets, so an example that stops working fails `make test`.
#
#   docs_commands_test.sh SOURCE_DIR BUILD_DIR
#
# A command line (`\` continuations joined) is one of:
#   * an `interlock` or `interlock-worker` command (build/... of the README,
#     BUILD_DIR here): run with its budget made short (see Shorten) and must
#     exit 0; a worker ending in `&` is started in the background on a free
#     port (the README's port is mapped to it in later commands) and stopped
#     at the end;
#   * set-up a later command needs (SETUP below: openssl, mkdir, the Python
#     export, ...): run in order and must exit 0;
#   * left to its own test (SKIP below, with the reason).
# Anything else fails the test: a new kind of README example gets a place
# here before it can ship.
#
# The commands run in a scratch folder that links every top-level entry of
# SOURCE_DIR (configs/, python/, .cache/, ...) except build/ (linked to
# BUILD_DIR), out/ and models/ (written by the commands, so fresh here).
# DOCS_TEST_DRY_RUN=1 only prints each command as it would run.
set -uo pipefail

SRC="$(cd "${1:?usage: docs_commands_test.sh SOURCE_DIR BUILD_DIR}" && pwd)"
BUILD="$(cd "${2:?usage: docs_commands_test.sh SOURCE_DIR BUILD_DIR}" && pwd)"
README="$SRC/README.md"
DRY="${DOCS_TEST_DRY_RUN:-0}"
TIMEOUT_S=300  # one command; ctest's TIMEOUT bounds the whole test
BUDGET_S=240   # the whole test should stay under this on 2 cores

# Programs of set-up lines, run in order in the scratch folder.
declare -A SETUP=(
  [mkdir]=1 [openssl]=1 [printf]=1 [echo]=1 [cp]=1 [ln]=1 [touch]=1
  [cat]=1 [tee]=1 [export]=1 [cd]=1 [/usr/bin/python3]=1 [python3]=1
)
# Programs left to their own tests, with the reason.
declare -A SKIP=(
  [make]="the build and the whole test suite, this test included; make run's train command is in the README and runs here"
  [kubectl]="needs a Kubernetes cluster: tests/deploy checks the manifests"
  [buildah]="image build: tests/deploy/image_context_test.sh checks its context"
  [podman]="image build or run: tests/deploy/image_context_test.sh"
  [docker]="image build or run: tests/deploy/image_context_test.sh"
  [deploy/image.sh]="image build: tests/deploy/image_context_test.sh"
)

WORK="$(mktemp -d /tmp/interlock-docs-XXXXXX)"
declare -a BG_PIDS=()
cleanup() {
  local pid
  for pid in "${BG_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${BG_PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  cd / && rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Should this script be killed outright (a ctest timeout), a watchdog stops
# the background workers it started (their pids are in .docs-test/pids).
mkdir -p "$WORK/.docs-test"
: >"$WORK/.docs-test/pids"
(
  trap '' INT TERM
  while kill -0 $$ 2>/dev/null; do sleep 2; done
  [[ -f "$WORK/.docs-test/pids" ]] && xargs -r kill -KILL <"$WORK/.docs-test/pids" 2>/dev/null
  rm -rf "$WORK"
) >/dev/null 2>&1 &

for entry in "$SRC"/* "$SRC"/.[!.]*; do
  [[ -e "$entry" ]] || continue
  case "$(basename "$entry")" in
    build | out | models | .git) ;;
    *) ln -s "$entry" "$WORK/$(basename "$entry")" ;;
  esac
done
ln -s "$BUILD" "$WORK/build"
cd "$WORK" || exit 1

# ---- Extract: every line of every ```sh block, continuations joined.
declare -a LINES=() LINENOS=()
in_sh=0 pending="" pending_no=0 n=0
while IFS= read -r line || [[ -n "$line" ]]; do
  n=$((n + 1))
  if ((in_sh == 0)); then
    [[ "$line" =~ ^[[:space:]]*\`\`\`sh[[:space:]]*$ ]] && in_sh=1
    continue
  fi
  if [[ "$line" =~ ^[[:space:]]*\`\`\`[[:space:]]*$ ]]; then
    in_sh=0
    continue
  fi
  ((pending_no == 0)) && pending_no=$n
  if [[ "$line" =~ ^(.*)\\[[:space:]]*$ ]]; then
    pending+="${BASH_REMATCH[1]} "
    continue
  fi
  pending+="$line"
  # Blank lines and comments are no commands.
  if [[ ! "$pending" =~ ^[[:space:]]*(#.*)?$ ]]; then
    LINES+=("$pending")
    LINENOS+=("$pending_no")
  fi
  pending="" pending_no=0
done <"$README"
if ((${#LINES[@]} == 0)); then
  echo "docs: no command found in the \`\`\`sh blocks of $README"
  exit 1
fi

# ---- Rewrites.
declare -A PORTS=()  # README port -> the free port a worker got here

# Maps the README's worker ports in one argument.
MapPorts() {
  local arg="$1" p host
  for p in "${!PORTS[@]}"; do
    for host in 127.0.0.1 localhost; do
      arg="${arg//$host:$p/$host:${PORTS[$p]}}"
    done
  done
  printf '%s' "$arg"
}

# Shorten PROGRAM ARGS...: sets OUT_ARGS to the arguments with short
# budgets: train gets `--steps 3` (with checkpoints: `--steps 4
# --checkpoint-every 2`), compare `--steps 2` (it evaluates every mode at
# every step of so short a run), no `--epochs`, budgets of a few
# seconds; every fixed metrics port becomes 0 (any free one); worker
# addresses are mapped to the ports the workers got here.
Shorten() {
  local prog="$1"
  shift
  local -a in=("$@")
  OUT_ARGS=()
  local sub="" steps=3 has_steps=0 has_ckpt=0 i=0 a name value
  [[ "$prog" == */interlock ]] && sub="${in[0]:-}"
  for a in "${in[@]}"; do
    [[ "$a" == --checkpoint-every* || "$a" == --checkpoint_every* ]] && has_ckpt=1
  done
  # compare evaluates every mode at every step of so short a run.
  [[ "$sub" == compare ]] && steps=2
  ((has_ckpt)) && steps=4
  while ((i < ${#in[@]})); do
    a="$(MapPorts "${in[$i]}")"
    i=$((i + 1))
    if [[ "$a" != --* ]]; then
      OUT_ARGS+=("$a")
      continue
    fi
    # --name value or --name=value, dashes or underscores.
    if [[ "$a" == *=* ]]; then
      name="${a%%=*}" value="${a#*=}"
    else
      name="$a" value=""
      case "${name//_/-}" in
        --steps | --epochs | --budget | --budget-virtual | --checkpoint-every | \
          --metrics-port | --port)
          value="$(MapPorts "${in[$i]:-}")"
          i=$((i + 1))
          ;;
      esac
    fi
    case "$sub:${name//_/-}" in
      train:--steps | compare:--steps)
        has_steps=1
        OUT_ARGS+=(--steps "$steps")
        ;;
      train:--epochs | compare:--epochs) ;;
      train:--budget | compare:--budget) OUT_ARGS+=("$name" 20s) ;;
      train:--budget-virtual | compare:--budget-virtual)
        OUT_ARGS+=("$name" 2s)
        ;;
      train:--checkpoint-every) OUT_ARGS+=("$name" 2) ;;
      *:--metrics-port)
        if [[ "$value" =~ ^[1-9] ]]; then value=0; fi
        OUT_ARGS+=("$name" "$value")
        ;;
      *)
        if [[ "$a" != *=* && -n "$value" ]]; then
          OUT_ARGS+=("$name" "$value")
        else
          OUT_ARGS+=("$a")
        fi
        ;;
    esac
  done
  if [[ ("$sub" == train || "$sub" == compare) && $has_steps == 0 ]]; then
    OUT_ARGS+=(--steps "$steps")
  fi
}

# ---- Run.
failures=0 ran=0 skipped=0
declare -a TIMES=()
start_all=$SECONDS

Fail() {  # Fail WHAT LOG: reports a failed line with its output's tail.
  echo "FAIL  README.md:$1"
  echo "      $2"
  if [[ -f "$3" ]]; then
    echo "      ---- last 20 lines of output ----"
    tail -n 20 "$3" | sed 's/^/      /'
  fi
  failures=$((failures + 1))
}

for idx in "${!LINES[@]}"; do
  raw="${LINES[$idx]}"
  where="${LINENOS[$idx]}"
  # Strip leading blanks; a trailing `&` means in the background.
  line="${raw#"${raw%%[![:space:]]*}"}"
  background=0
  if [[ "$line" =~ ^(.*[^\&])\&[[:space:]]*$ ]]; then
    background=1
    line="${BASH_REMATCH[1]}"
  fi
  read -r prog _ <<<"$line"
  log="$WORK/.docs-test/line$where.log"

  case "$prog" in
    build/coordinator/interlock | build/worker/interlock-worker)
      # The words of the line, as the shell reads them (quotes, comments).
      words=()
      if ! eval "words=( $line )" 2>/dev/null; then
        Fail "$where" "$raw (the shell cannot read it as one command)" ""
        continue
      fi
      Shorten "$prog" "${words[@]:1}"
      args=("${OUT_ARGS[@]}")
      if ((background)); then
        if [[ "$prog" != build/worker/interlock-worker ]]; then
          Fail "$where" "$raw (only workers run in the background)" ""
          continue
        fi
        # A free port: --port 0 with a port file, the README's port mapped.
        readme_port=7070 metrics_given=0
        declare -a wargs=()
        i=0
        while ((i < ${#args[@]})); do
          case "${args[$i]//_/-}" in
            --port) readme_port="${args[$((i + 1))]}"; i=$((i + 2)); continue ;;
            --port=*) readme_port="${args[$i]#*=}"; i=$((i + 1)); continue ;;
            --metrics-port | --metrics-port=*) metrics_given=1 ;;
          esac
          wargs+=("${args[$i]}")
          i=$((i + 1))
        done
        ((metrics_given)) || wargs+=(--metrics_port 0)
        port_file="$WORK/.docs-test/port.$readme_port"
        wargs+=(--port 0 --port_file "$port_file")
        echo "RUN&  README.md:$where: $prog ${wargs[*]}"
        ((DRY)) && { PORTS[$readme_port]=$readme_port; continue; }
        "$prog" "${wargs[@]}" >"$log" 2>&1 &
        pid=$!
        BG_PIDS+=("$pid")
        echo "$pid" >>"$WORK/.docs-test/pids"
        for _ in $(seq 300); do
          [[ -s "$port_file" ]] && break
          kill -0 "$pid" 2>/dev/null || break
          sleep 0.1
        done
        if [[ ! -s "$port_file" ]]; then
          Fail "$where" "$raw (the worker did not start serving)" "$log"
          continue
        fi
        read -r grpc_port _ <"$port_file"
        PORTS[$readme_port]=$grpc_port
        echo "      port $readme_port -> $grpc_port"
        ran=$((ran + 1))
        continue
      fi
      echo "RUN   README.md:$where: $prog ${args[*]}"
      ((DRY)) && continue
      t0=$SECONDS
      timeout -k 10 "$TIMEOUT_S" "$prog" "${args[@]}" </dev/null >"$log" 2>&1
      rc=$?
      TIMES+=("$((SECONDS - t0)) s  README.md:$where: ${words[0]} ${words[1]:-}")
      echo "      exit $rc after $((SECONDS - t0)) s"
      if ((rc != 0)); then
        Fail "$where" "$prog ${args[*]} (exit $rc)" "$log"
      fi
      ran=$((ran + 1))
      ;;
    *)
      if [[ -n "${SKIP[$prog]:-}" ]]; then
        echo "SKIP  README.md:$where: $line (${SKIP[$prog]})"
        skipped=$((skipped + 1))
        continue
      fi
      if [[ -z "${SETUP[$prog]:-}" ]]; then
        Fail "$where" "$raw (not an interlock command, nor known set-up or skipped: add it to SETUP or SKIP in tests/docs_commands_test.sh)" ""
        continue
      fi
      echo "SETUP README.md:$where: $line$( ((background)) && echo ' &')"
      ((DRY)) && continue
      if ((background)); then
        eval "$line" >"$log" 2>&1 &
        BG_PIDS+=("$!")
        echo "$!" >>"$WORK/.docs-test/pids"
        continue
      fi
      eval "$line" </dev/null >"$log" 2>&1
      rc=$?
      if ((rc != 0)); then
        Fail "$where" "$line (exit $rc)" "$log"
      fi
      if [[ "$PWD" != "$WORK" && "$PWD" != "$WORK"/* ]]; then
        Fail "$where" "$line (left the scratch folder: $PWD)" ""
        cd "$WORK" || exit 1
      fi
      ;;
  esac
done

total=$((SECONDS - start_all))
echo
if ((${#TIMES[@]})); then
  echo "Per command:"
  printf '  %s\n' "${TIMES[@]}"
fi
echo "docs: ${#LINES[@]} lines: $ran interlock commands run, $skipped skipped," \
  "$failures failed; $total s in all"
if ((total > BUDGET_S)); then
  echo "docs: WARNING: over the ${BUDGET_S} s meant for this test on 2 cores;" \
    "shorten the budgets in tests/docs_commands_test.sh"
fi
((failures == 0))
