#!/usr/bin/env bash
# Wheels of what benchmarks/gpu_check.sh needs beside a CUDA torch, for a GPU host that
# cannot reach the package index: run here, then take .whl/ along.
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION [PACKAGE ...]]   (default 3.12, all)  fills .whl/
#   benchmarks/gpu_wheels.sh --list                           prints the requirements
#
# Name packages to fetch only those the host lacks: a CUDA image with PyTorch usually
# holds all but pyzmq, msgspec, structlog, cbor2 and pytest-asyncio, and a wheel carried
# beside the host's own copy of a package shadows it.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=(pyzmq msgspec structlog cbor2 pytest pytest-asyncio pytest-timeout anyio markdown-it-py mdurl pygments
              xxhash rich prometheus-client psutil pyyaml numpy hypothesis sortedcontainers
              attrs idna sniffio typing-extensions pluggy iniconfig packaging)
if [ "${1:-}" = "--list" ]; then
  echo "${requirements[@]}"
  exit 0
fi
version="${1:-3.12}"
shift || true
[ "$#" -gt 0 ] && requirements=("$@")
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version "$version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${requirements[@]}"
