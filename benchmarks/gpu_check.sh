#!/usr/bin/env bash
# The GPU checks in one run of a few minutes: the tests marked gpu (byte-exact save and
# load of GPU tensors shared by another process, cleanup after SIGKILL, event ordering),
# then the CUDA copy benchmark (through the sidecar against a bare pinned copy_).
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (default: bench-results/gpu)
#
# Needs what benchmarks/gpu_env.sh says (a CUDA torch, a C compiler, OpenSSL's headers);
# benchmarks/gpu_wheels.sh fills .whl/ for a host that cannot reach the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/gpu}"
mkdir -p "$out"
source benchmarks/gpu_env.sh
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"

"$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))' | tee "$out/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$out/gpu.txt" 2>&1 || true
build_here . "$out/build.log"

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
