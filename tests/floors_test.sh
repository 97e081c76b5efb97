#!/usr/bin/env bash
# The floors of the source tree: no folder includes a header of a folder
# above it. plan/ (pure logic) includes nothing of ours outside itself;
# services/ (training, no gRPC) never reaches analysis/, rpc/, worker/ or
# coordinator/; and so on up to coordinator/, which may use everything but
# the worker's own code. Each line of FLOORS below is a folder and the
# folders of ours it may include. Prints every include that breaks a floor
# and exits 1; usage: floors_test.sh [SOURCE_DIR].
set -euo pipefail
ROOT="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$ROOT"

declare -A FLOORS=(
  [plan]="plan"
  [proto]="proto"
  [metrics]="metrics"
  [analysis]="plan proto analysis"
  [services]="plan proto services"
  [collective]="plan proto services collective"
  [rpc]="plan proto services rpc"
  [worker]="plan proto services collective rpc metrics worker"
  [coordinator]="plan proto analysis services collective rpc metrics coordinator"
)
# Every folder the build adds has a floor: a new folder must be placed.
for dir in $(sed -nE 's/^[[:space:]]*add_subdirectory\(([a-z_]+)\).*/\1/p' CMakeLists.txt); do
  [[ "$dir" == tests ]] && continue
  if [[ -z "${FLOORS[$dir]+x}" ]]; then
    echo "floors: $dir/ is built (CMakeLists.txt) but has no floor in $0" >&2
    exit 1
  fi
done

ours="$(printf '%s\n' "${!FLOORS[@]}" tests | paste -sd'|')"
bad=0
for dir in "${!FLOORS[@]}"; do
  [[ -d "$dir" ]] || continue
  allowed=" ${FLOORS[$dir]} "
  while IFS=: read -r file line text; do
    target="$(sed -nE "s/^[[:space:]]*#[[:space:]]*include[[:space:]]+\"(${ours})\/.*/\1/p" <<<"$text")"
    [[ -z "$target" ]] && continue
    if [[ "$allowed" != *" $target "* ]]; then
      echo "floors: $file:$line includes $target/ (${dir}/ may include: ${FLOORS[$dir]})" >&2
      bad=1
    fi
  done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"' "$dir" \
             --include='*.h' --include='*.cc' --include='*.proto' || true)
  # .proto imports are includes too.
  while IFS=: read -r file line text; do
    target="$(sed -nE "s/^import[[:space:]]+\"(${ours})\/.*/\1/p" <<<"$text")"
    [[ -z "$target" ]] && continue
    if [[ "$allowed" != *" $target "* ]]; then
      echo "floors: $file:$line imports $target/ (${dir}/ may include: ${FLOORS[$dir]})" >&2
      bad=1
    fi
  done < <(grep -rnE '^import[[:space:]]+"' "$dir" --include='*.proto' || true)
done
if ((bad)); then exit 1; fi
echo "floors: every include keeps to its floor"
