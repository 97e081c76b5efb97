#!/usr/bin/env bash
# Installs every Debian package Interlock needs and prepares the data caches.
# Idempotent: when everything is present it only checks and returns.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config ninja-build clang-format
  libtorch-dev libopenblas0-pthread
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgoogle-glog-dev libgflags-dev
  libgtest-dev libgmock-dev libbenchmark-dev libssl-dev zlib1g-dev
  dataset-fashion-mnist bible-kjv gnuplot-nox procps python3
)

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

# Text corpus: the King James Bible, extracted once.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${INTERLOCK_DATA_DIR:-$ROOT/.cache/data}"
mkdir -p "$CACHE"
if [[ ! -s "$CACHE/kjv.txt" ]]; then
  echo "setup: extracting the King James Bible to $CACHE/kjv.txt"
  bible -f -p /usr/lib Gen1:1-Rev22:21 >"$CACHE/kjv.txt.tmp"
  mv "$CACHE/kjv.txt.tmp" "$CACHE/kjv.txt"
fi
