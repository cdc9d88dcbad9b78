#!/usr/bin/env bash
# The GPU checks in one run of a few minutes: the tests marked gpu (byte-exact save and
# load of GPU tensors shared by another process, cleanup after SIGKILL, event ordering),
# then the CUDA copy benchmark (through the sidecar against a bare pinned copy_).
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (default: bench-results/gpu)
#
# Needs python3 (or $PYTHON) with a CUDA build of torch, setuptools, a C compiler and
# OpenSSL's headers (CFLAGS and LDFLAGS reach the compiler). The project's other packages
# are installed from .whl/ when that folder exists (benchmarks/gpu_wheels.sh fills it on
# a machine that reaches the package index), else from the index. The C extensions are
# built in place for that Python.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/gpu}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

site=/tmp/kvsidecar-site
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
else
  "$py" -m pip install -q --target "$site" $(benchmarks/gpu_wheels.sh --list)
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"

"$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))' | tee "$out/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$out/gpu.txt" 2>&1 || true
if ! "$py" -c 'from setuptools import setup; setup()' build_ext --inplace -q \
    >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi

set +e
# Only the plugins the suite needs: a host's own (older or newer) stay out of the run.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
timeout 300 "$py" -m pytest -p pytest_asyncio.plugin -p pytest_timeout --timeout 120 \
  tests/gpu tests/unit/transport/test_cuda_ipc.py tests/integration/test_shared_tensors.py \
  -q -p no:cacheprovider 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
timeout 240 "$py" benchmarks/bench_cuda_copy.py --repeat 3 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
cp benchmarks/results/bench_cuda_copy.json "$out/" 2>/dev/null
echo "gpu_check: tests exit $tests, benchmark exit $bench" | tee -a "$out/gpu.txt"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
