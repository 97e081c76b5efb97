#!/usr/bin/env bash
# Builds the Interlock container image with buildah (chroot isolation), and
# smoke-tests it.
#
#   deploy/image.sh base    # only the Debian 12 base image (debootstrap)
#   deploy/image.sh build   # base if missing, then deploy/Containerfile
#   deploy/image.sh test    # smoke test of the built image (buildah run)
#   deploy/image.sh context DIR [head|worktree]
#                           # only the build context, written into DIR
#
# The image is built from the committed tree (git archive HEAD), so edits in
# progress never end up in it; the Containerfile's build stage copies that
# whole context. `context DIR worktree` makes the same context from the files
# the next commit would hold (tracked and untracked, not ignored):
# tests/deploy/image_context_test.sh checks it against the Containerfile.
# When no Debian 12 base image is in buildah's store, one is made with
# debootstrap from the apt mirror this machine uses; the root file system
# tarball is cached under .cache/image/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$ROOT/.cache/image"
IMAGE="${IMAGE:-localhost/interlock:latest}"
BASE_IMAGE="${BASE_IMAGE:-localhost/interlock-debian12:latest}"
JOBS="${JOBS:-2}"

log() { echo "image: $*" >&2; }
die() { echo "image: error: $*" >&2; exit 1; }

# The first Debian mirror in this machine's apt sources (deb822 or one-line).
host_mirror() {
  local uri=""
  if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
    uri=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' \
      /etc/apt/sources.list.d/*.sources)
  fi
  if [[ -z "$uri" && -f /etc/apt/sources.list ]]; then
    uri=$(awk '$1 == "deb" && $0 !~ /security/ {
      for (i = 2; i <= NF; ++i) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}
    }' /etc/apt/sources.list)
  fi
  [[ -n "$uri" ]] || die "no Debian mirror found in /etc/apt/sources*"
  echo "$uri"
}

have_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }

# Writes the build context into DIR (created; must be empty): 'head' is the
# committed tree (git archive HEAD), what `build` uses; 'worktree' is the
# working tree's tracked and untracked, not ignored files that exist.
make_context() {
  local dir="$1" from="${2:-head}"
  git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1 || die "$ROOT is not a git checkout"
  mkdir -p "$dir"
  [[ -z "$(ls -A "$dir")" ]] || die "context folder $dir is not empty"
  case "$from" in
    head)
      git -C "$ROOT" rev-parse --verify -q HEAD >/dev/null || die "no commit to build"
      git -C "$ROOT" archive HEAD | tar -x -C "$dir"
      ;;
    worktree)
      git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do
            if [[ -e "$ROOT/$f" || -L "$ROOT/$f" ]]; then printf '%s\0' "$f"; fi
          done \
        | tar -C "$ROOT" --null --no-recursion -T - -cf - | tar -x -C "$dir"
      ;;
    *) die "unknown context source '$from'; expected head or worktree" ;;
  esac
}

build_base() {
  mkdir -p "$CACHE"
  if have_image "$BASE_IMAGE"; then
    log "base $BASE_IMAGE already present"
    return
  fi
  local tarball="$CACHE/debian12-rootfs.tar.gz"
  if [[ ! -s "$tarball" ]]; then
    command -v debootstrap >/dev/null || die "debootstrap is not installed (scripts/setup.sh)"
    local mirror rootfs="$CACHE/rootfs"
    mirror=$(host_mirror)
    log "debootstrap bookworm (minbase) from $mirror"
    rm -rf "$rootfs"
    mkdir -p "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$CACHE/debootstrap.log" 2>&1 \
      || die "debootstrap failed, see $CACHE/debootstrap.log"
    # Same apt sources as this machine (updates and security included).
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
      rm -f "$rootfs/etc/apt/sources.list"
      cp /etc/apt/sources.list.d/*.sources "$rootfs/etc/apt/sources.list.d/"
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -czf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  log "importing $tarball as $BASE_IMAGE"
  local ctr
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$tarball" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash "$ctr"
  buildah commit --rm "$ctr" "$BASE_IMAGE" >/dev/null
}

build_image() {
  build_base
  git -C "$ROOT" rev-parse --verify -q HEAD >/dev/null || die "no commit to build"
  local ctx start
  ctx=$(mktemp -d "$CACHE/context.XXXXXX")
  trap 'rm -rf "$ctx"' RETURN
  make_context "$ctx" head
  log "building $IMAGE from $(git -C "$ROOT" rev-parse --short HEAD) (JOBS=$JOBS)"
  start=$(date +%s)
  buildah bud --isolation chroot --layers \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "JOBS=$JOBS" \
    --label "org.opencontainers.image.revision=$(git -C "$ROOT" rev-parse HEAD)" \
    -f "$ctx/deploy/Containerfile" -t "$IMAGE" "$ctx"
  log "built $IMAGE in $(($(date +%s) - start)) s"
}

# Runs inside the image (buildah run): the binaries start, the user is not
# root, a worker answers the gRPC health protocol (NOT_SERVING until it holds
# a block, 'liveness' SERVING), and a three-block training over real workers
# turns them SERVING.
SMOKE_SCRIPT='
set -eu
fail() { echo "smoke: FAIL: $*" >&2; exit 1; }
[ "$(id -u)" != 0 ] || fail "runs as root"
out=$(interlock-worker --help 2>&1) && fail "--help exited 0"
echo "$out" | grep -q -- "--health_check" || fail "--help: $out"
for b in interlock interlock-coordinator; do
  out=$($b --help 2>&1) || true
  echo "$out" | grep -q "interlock train --config" || fail "$b --help: $out"
done
dir=$(mktemp -d)
pids=""
trap "kill \$pids 2>/dev/null || true" EXIT
for k in 0 1 2; do
  interlock-worker --host=127.0.0.1 --port=0 --metrics_port=0 \
    --port_file=$dir/w$k.port 2>$dir/w$k.log &
  pids="$pids $!"
done
addrs=""
for k in 0 1 2; do
  i=0
  while [ ! -s $dir/w$k.port ]; do
    i=$((i + 1)); [ $i -lt 300 ] || fail "worker $k did not start: $(cat $dir/w$k.log)"
    sleep 0.1
  done
  read port metrics <$dir/w$k.port
  addrs="$addrs${addrs:+,}127.0.0.1:$port"
done
first=${addrs%%,*}
state=$(interlock-worker --health_check=$first) && fail "fresh worker: $state"
[ "$state" = NOT_SERVING ] || fail "fresh worker health: $state"
interlock-worker --health_check=$first --health_service=liveness >/dev/null \
  || fail "liveness not SERVING"
interlock-coordinator --config=/opt/interlock/configs/tests/tiny_resnet.pbtxt \
  --workers=$addrs --steps=4 --quiet --out=$dir/out
[ -s $dir/out/summary.json ] || fail "no summary.json"
state=$(interlock-worker --health_check=$first) || fail "configured worker: $state"
echo "smoke: PASS (worker health NOT_SERVING -> $state, 4 steps on 3 workers)"
'

smoke_test() {
  have_image "$IMAGE" || die "$IMAGE is not built (make image)"
  local ctr
  ctr=$(buildah from "$IMAGE")
  trap 'buildah rm "$ctr" >/dev/null' RETURN
  buildah run --isolation chroot "$ctr" -- sh -c "$SMOKE_SCRIPT"
}

case "${1:-build}" in
  base) build_base ;;
  build) build_image ;;
  test) smoke_test ;;
  context)
    [[ $# -ge 2 && $# -le 3 ]] || die "usage: deploy/image.sh context DIR [head|worktree]"
    make_context "$2" "${3:-head}"
    ;;
  *) die "unknown command '${1}'; expected base, build, test or context" ;;
esac
