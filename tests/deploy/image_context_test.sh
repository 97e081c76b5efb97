#!/usr/bin/env bash
# Checks, without building the image, that the container image's build stage
# gets everything the CMake build needs:
#
#  1. makes the build context the way `deploy/image.sh build` does
#     (`deploy/image.sh context DIR`), from the files the next commit would
#     hold (tracked and untracked, not ignored; IMAGE_CONTEXT_FROM=head for
#     the committed tree only, exactly what `make image` builds);
#  2. every local COPY/ADD source of the Containerfile is in that context
#     (after .containerignore/.dockerignore, if the context has one);
#  3. replays the build stage's COPY lines into a scratch folder and checks
#     that the folder `cmake -S DIR` configures holds every add_subdirectory()
#     target of the top-level CMakeLists.txt (if() branches included, and
#     recursively), every repository path a reached CMakeLists.txt names as
#     ${CMAKE_SOURCE_DIR}/... or ${CMAKE_CURRENT_SOURCE_DIR}/..., and every
#     repository file a copied source #includes or a copied .proto imports.
#
#   bash tests/deploy/image_context_test.sh
#   CONTAINERFILE=/tmp/old.Containerfile bash tests/deploy/image_context_test.sh
#
# Environment: CONTAINERFILE (default: deploy/Containerfile of the context),
# IMAGE_CONTEXT_FROM (worktree or head, default worktree), BUILD_STAGE (the
# stage's AS name, default build). Exit 0 pass, 1 fail, 77 skipped (not a git
# checkout).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FROM_SRC="${IMAGE_CONTEXT_FROM:-worktree}"
BUILD_STAGE="${BUILD_STAGE:-build}"

if ! git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  echo "image_context_test: SKIP: $ROOT is not a git checkout"
  exit 77
fi

errors=0
fail() { echo "FAIL: $*"; errors=$((errors + 1)); }
note() { echo "image_context_test: $*"; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ctx="$tmp/context"   # the build context, as deploy/image.sh makes it
root="$tmp/root"     # the build stage's file system: only what COPY puts there
mkdir -p "$root"

bash "$ROOT/deploy/image.sh" context "$ctx" "$FROM_SRC"
CONTAINERFILE="${CONTAINERFILE:-$ctx/deploy/Containerfile}"
[[ -f "$CONTAINERFILE" ]] || { echo "FAIL: no Containerfile at $CONTAINERFILE"; exit 1; }
note "context from $FROM_SRC: $(find "$ctx" -type f | wc -l) files, $(du -sh "$ctx" | cut -f1); Containerfile: $CONTAINERFILE"

# ---- what buildah sends: the context less .containerignore/.dockerignore ---
# (buildah reads the first of the two in the context folder). Patterns are
# matched as bash globs from the context root (** with globstar); negations
# are not modelled.
eff="$ctx"
for ignore in .containerignore .dockerignore; do
  [[ -f "$ctx/$ignore" ]] || continue
  eff="$tmp/effective"
  cp -a "$ctx" "$eff"
  while IFS= read -r pat || [[ -n "$pat" ]]; do
    pat="${pat#"${pat%%[![:space:]]*}"}"
    pat="${pat%"${pat##*[![:space:]]}"}"
    [[ -z "$pat" || "$pat" == \#* ]] && continue
    if [[ "$pat" == !* ]]; then
      fail "$ignore: negated pattern '$pat' is not modelled by this test; extend it"
      continue
    fi
    pat="${pat#/}"
    (
      cd "$eff"
      shopt -s globstar dotglob nullglob
      IFS=
      for m in $pat; do rm -rf -- "$m"; done
    )
  done <"$ctx/$ignore"
  note "applied $ignore"
  break
done

# ---- the Containerfile as logical instructions ------------------------------
instrs=()
cur=""
while IFS= read -r line || [[ -n "$line" ]]; do
  [[ "$line" =~ ^[[:space:]]*# ]] && continue        # comments, also within a continuation
  [[ -z "${line//[[:space:]]/}" ]] && continue       # blank lines
  if [[ "$line" =~ ^(.*)\\[[:space:]]*$ ]]; then
    cur+="${BASH_REMATCH[1]} "
    continue
  fi
  instrs+=("$cur$line")
  cur=""
done <"$CONTAINERFILE"
[[ -z "${cur//[[:space:]]/}" ]] || instrs+=("$cur")

# Matches of a COPY source in the (effective) context, one per line; none
# when it is missing.
matches() {
  local src="${1#/}" m
  (
    cd "$eff"
    shopt -s nullglob dotglob
    IFS=
    for m in ${src:-.}; do
      if [[ -e "$m" || -L "$m" ]]; then printf '%s\n' "$m"; fi
    done
  )
}

# Copies one context path to DEST in the stage the way COPY does: a folder's
# contents into DEST, a file into DEST/ when DEST is (or must be) a folder.
replay_copy() {
  local src="$1" dest="$2" into="$3"
  if [[ -d "$eff/$src" && ! -L "$eff/$src" ]]; then
    mkdir -p "$root$dest"
    cp -a "$eff/$src/." "$root$dest/"
  elif [[ "$into" == 1 || -d "$root$dest" ]]; then
    mkdir -p "$root$dest"
    cp -a "$eff/$src" "$root$dest/"
  else
    mkdir -p "$(dirname "$root$dest")"
    cp -a "$eff/$src" "$root$dest"
  fi
}

in_build=0
found_stage=0
workdir=/
src_dir=""
copies=0
for ins in "${instrs[@]}"; do
  read -r kw rest <<<"$ins"
  kw="${kw^^}"
  case "$kw" in
    FROM)
      read -ra words <<<"$rest"
      in_build=0
      workdir=/
      if (( ${#words[@]} >= 3 )) && [[ "${words[-2]^^}" == AS && "${words[-1]}" == "$BUILD_STAGE" ]]; then
        in_build=1
        found_stage=1
      fi
      ;;
    WORKDIR)
      if [[ "$rest" == /* ]]; then workdir="$rest"; else workdir="${workdir%/}/$rest"; fi
      ;;
    RUN)
      if (( in_build )) && [[ -z "$src_dir" && "$rest" =~ cmake[[:space:]]+(.*[[:space:]])?-S[[:space:]]*([^[:space:]]+) ]]; then
        src_dir="${BASH_REMATCH[2]}"
        [[ "$src_dir" == /* ]] || src_dir="${workdir%/}/$src_dir"
        src_dir="$(realpath -m "$src_dir")"
      fi
      ;;
    COPY|ADD)
      if [[ "$rest" =~ ^\[ ]]; then                     # JSON form
        mapfile -t words < <(grep -o '"[^"]*"' <<<"$rest" | sed 's/^"//; s/"$//')
      else
        read -ra words <<<"$rest"
      fi
      from_stage=0
      args=()
      for w in "${words[@]}"; do
        case "$w" in
          --from=*) from_stage=1 ;;
          --chown=*|--chmod=*|--link|--link=*) ;;
          --*) fail "$kw option '$w' is not modelled by this test; extend it: $ins" ;;
          *) args+=("$w") ;;
        esac
      done
      (( from_stage )) && continue
      if (( ${#args[@]} < 2 )); then
        fail "cannot parse: $ins"
        continue
      fi
      dest="${args[-1]}"
      [[ "$dest" == /* ]] || dest="${workdir%/}/$dest"
      into=0
      [[ "$dest" == */ ]] && into=1
      (( ${#args[@]} > 2 )) && into=1
      for src in "${args[@]:0:${#args[@]}-1}"; do
        if [[ "$kw" == ADD && "$src" =~ ^[a-z]+:// ]]; then continue; fi
        mapfile -t found < <(matches "$src")
        if (( ${#found[@]} == 0 )); then
          fail "$kw source '$src' is not in the build context: $ins"
          continue
        fi
        (( ${#found[@]} > 1 )) && into=1
        if (( in_build )); then
          for m in "${found[@]}"; do replay_copy "$m" "$(realpath -m "$dest")" "$into"; done
          copies=$((copies + 1))
        fi
      done
      ;;
  esac
done

if (( ! found_stage )); then
  echo "FAIL: no stage 'FROM ... AS $BUILD_STAGE' in $CONTAINERFILE"
  exit 1
fi
if [[ -z "$src_dir" ]]; then
  echo "FAIL: stage '$BUILD_STAGE' runs no 'cmake -S DIR' (the source folder to check)"
  exit 1
fi
src="$root$src_dir"
note "stage '$BUILD_STAGE': $copies COPY sources replayed, CMake source folder $src_dir"

# ---- the CMake folders the build configures ----------------------------------
# Follows add_subdirectory() through the repository (the context), from the
# top-level CMakeLists.txt, and checks each folder in the stage's $src_dir.
# A relative path with '.', '..' and repeated '/' resolved, in NORM (no
# subshell: it runs once per include).
norm() {
  local IFS=/ part
  local -a parts out=()
  read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    case "$part" in
      ''|.) ;;
      ..) (( ${#out[@]} )) && unset 'out[-1]' ;;
      *) out+=("$part") ;;
    esac
  done
  NORM="${out[*]}"
  NORM="${NORM:-.}"
}
declare -A seen=()
queue=(".")
reached=()
while (( ${#queue[@]} )); do
  d="${queue[0]}"
  queue=("${queue[@]:1}")
  [[ -n "${seen[$d]:-}" ]] && continue
  seen[$d]=1
  rel="$d/CMakeLists.txt"
  [[ "$d" == . ]] && rel="CMakeLists.txt"
  if [[ ! -f "$ctx/$rel" ]]; then
    fail "$rel is added by the build but is not in the build context (not committed, or ignored?)"
    continue
  fi
  reached+=("$d")
  [[ -f "$src/$rel" ]] || fail "$rel does not reach $src_dir/$rel in the build stage"
  # Comments dropped, lines joined (an add_subdirectory( may span lines).
  body=$(sed 's/#.*$//' "$ctx/$rel" | tr '\n' ' ')
  while IFS= read -r sub; do
    [[ -z "$sub" ]] && continue
    sub="${sub#*(}"
    read -r sub _ <<<"$sub"
    sub="${sub//\"/}"
    sub="${sub/\$\{CMAKE_CURRENT_SOURCE_DIR\}\//}"
    if [[ "$sub" == \$\{CMAKE_SOURCE_DIR\}/* ]]; then
      norm "${sub#*/}"
      sub="$NORM"
    elif [[ "$sub" == *'${'* || "$sub" == /* ]]; then
      note "$rel: add_subdirectory($sub) not checked (variable or absolute path)"
      continue
    else
      norm "$d/$sub"
      sub="$NORM"
    fi
    queue+=("$sub")
  done < <(grep -oiE 'add_subdirectory[[:space:]]*\([[:space:]]*[^)]+' <<<"$body" || true)
  # Repository paths the CMake code names.
  while IFS= read -r ref; do
    [[ -z "$ref" ]] && continue
    if [[ "$ref" == '${CMAKE_CURRENT_SOURCE_DIR}/'* ]]; then
      norm "$d/${ref#*/}"
    else
      norm "${ref#*/}"
    fi
    p="$NORM"
    if [[ -e "$ctx/$p" && ! -e "$src/$p" ]]; then
      fail "$rel names $ref: $p is in the repository but not in $src_dir in the build stage"
    fi
  done < <(grep -oE '\$\{CMAKE_(CURRENT_)?SOURCE_DIR\}/[A-Za-z0-9_.+/-]+' <<<"$body" | sort -u || true)
done
note "CMake folders reached: ${reached[*]}"

# ---- files the copied sources include ----------------------------------------
# '#include "x/y.h"' (from the file's folder or the source root, the include
# path the targets use) and proto 'import "x.proto"'. A repository file that a
# copied source needs must be copied too.
includes=0
declare -A missing=()   # missing path -> its includers
while IFS= read -r hit; do
  file="${hit%%:*}"
  file="${file#./}"
  inc="${hit#*:}"
  inc="${inc#*\"}"
  inc="${inc%\"*}"
  [[ -f "$src/$file" ]] || continue
  dir=.
  [[ "$file" == */* ]] && dir="${file%/*}"
  if [[ -e "$ctx/$dir/$inc" ]]; then
    norm "$dir/$inc"
  elif [[ -e "$ctx/$inc" ]]; then
    norm "$inc"
  else
    continue   # system or generated (e.g. proto/*.pb.h)
  fi
  p="$NORM"
  includes=$((includes + 1))
  [[ -e "$src/$p" ]] || missing[$p]+=" $file"
done < <(cd "$ctx" && grep -rHoE \
  --include='*.cc' --include='*.cpp' --include='*.h' --include='*.hpp' --include='*.proto' \
  '^[[:space:]]*(#[[:space:]]*include|import)[[:space:]]+"[^"]+"' . || true)
for p in $(printf '%s\n' "${!missing[@]}" | sort); do
  read -ra by <<<"${missing[$p]}"
  more=""
  (( ${#by[@]} > 1 )) && more=" and $((${#by[@]} - 1)) more"
  fail "$p is not in $src_dir in the build stage; ${by[0]}$more include it"
done
note "$includes repository includes/imports of copied sources checked"

if (( errors )); then
  echo "image_context_test: FAIL ($errors problem(s)): the image's build stage lacks what the build needs; see deploy/Containerfile"
  exit 1
fi
echo "image_context_test: PASS"
