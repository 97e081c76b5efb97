#!/usr/bin/env bash
# Installs every Debian package Interlock needs and prepares the data caches.
# Idempotent: when everything is present it only checks and returns.
#   --build-only   only what compiling needs (the container image's build
#                  stage): no operations tools, no data or npm caches.
set -euo pipefail

BUILD_ONLY=0
if [[ "${1:-}" == "--build-only" ]]; then BUILD_ONLY=1; fi

PACKAGES=(
  build-essential cmake pkg-config ninja-build clang-format
  libtorch-dev libopenblas0-pthread libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgoogle-glog-dev libgflags-dev
  libgtest-dev libgmock-dev libbenchmark-dev libssl-dev zlib1g-dev
  libpng-dev libjpeg62-turbo-dev
  dataset-fashion-mnist bible-kjv gnuplot-nox procps python3
)
# Operations (docs/OPERATIONS.md): Prometheus and promtool for the rule and
# dashboard tests, buildah and debootstrap for the container image, openssl.
# kubectl (with kustomize) and Node.js/npm are added below when missing.
# iproute2 (tc) shapes a link for tests/bench/wire_link.sh.
OPS_PACKAGES=(prometheus buildah debootstrap openssl ca-certificates iproute2)
# Tests make TLS certificates with the openssl CLI (above); `make fuzz` builds
# with clang 14 and its libFuzzer/sanitizer runtimes.
FUZZ_PACKAGES=(clang-14 libclang-rt-14-dev)
# The Python package (python/): export a user's model to TorchScript, load a
# trained one. The same PyTorch release (1.13) as libtorch-dev. The data
# format tests write .npy files with numpy and PNG / JPEG files with PIL.
PY_PACKAGES=(python3-torch python3-numpy python3-pil)
if ((BUILD_ONLY == 0)); then
  PACKAGES+=("${OPS_PACKAGES[@]}" "${FUZZ_PACKAGES[@]}" "${PY_PACKAGES[@]}")
  if ! command -v npm >/dev/null; then PACKAGES+=(nodejs npm); fi
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ((BUILD_ONLY)); then exit 0; fi

# kubectl with kustomize 5 (the manifest test). Debian 12's own
# kubernetes-client is too old for kustomize components; the kubectl package
# (1.32, kustomize 5.5) comes with this project's machines or their apt
# sources. Without it the manifest test is left out (cmake warns).
if ! command -v kubectl >/dev/null; then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends kubectl; then
    echo "setup: warning: no kubectl package in the apt sources; manifest test skipped" >&2
  fi
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Manifest validators (tests/deploy), pinned by the committed
# package-lock.json; installed once so that tests run offline.
DEPLOY_TESTS="$ROOT/tests/deploy"
if [[ ! -f "$DEPLOY_TESTS/node_modules/.package-lock.json" ||
      "$DEPLOY_TESTS/package-lock.json" -nt "$DEPLOY_TESTS/node_modules/.package-lock.json" ]]; then
  echo "setup: installing the manifest validators (npm ci in tests/deploy)"
  (cd "$DEPLOY_TESTS" && npm ci --no-audit --no-fund --loglevel=error)
fi

# Text corpus: the King James Bible, extracted once.
CACHE="${INTERLOCK_DATA_DIR:-$ROOT/.cache/data}"
mkdir -p "$CACHE"
if [[ ! -s "$CACHE/kjv.txt" ]]; then
  echo "setup: extracting the King James Bible to $CACHE/kjv.txt"
  bible -f -p /usr/lib Gen1:1-Rev22:21 >"$CACHE/kjv.txt.tmp"
  mv "$CACHE/kjv.txt.tmp" "$CACHE/kjv.txt"
fi
