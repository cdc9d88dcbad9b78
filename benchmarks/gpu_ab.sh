#!/usr/bin/env bash
# The CUDA copy benchmark A/B in one run: this tree against an older one, alternated,
# ROUNDS times at 4 and at 1 request in flight, then the median ratios of each.
#
#   git archive REV | (mkdir -p .base && tar -x -C .base)     (here, before the run)
#   benchmarks/gpu_ab.sh .base [OUT_DIR] [ROUNDS]    (default: bench-results/gpu-ab, 2)
#
# Both trees' C extensions are built for the host's Python (benchmarks/gpu_env.sh);
# BENCH_ARGS (say "--blocks 16 --page-kib 48") reach every benchmark run.
set -euo pipefail
cd "$(dirname "$0")/.."
base="$(cd "$1" && pwd)"
out="$(mkdir -p "${2:-bench-results/gpu-ab}" && cd "${2:-bench-results/gpu-ab}" && pwd)"
rounds="${3:-2}"
source benchmarks/gpu_env.sh
build_here . "$out/build.log"
build_here "$base" "$out/build-base.log"

bench() {  # TREE NAME IN_FLIGHT ROUND
  local tree=$1 name=$2 in_flight=$3 round=$4
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  if (cd "$tree" && PYTHONPATH="$tree:$site" timeout 300 "$py" benchmarks/bench_cuda_copy.py \
        --repeat 3 --concurrency "$in_flight" ${BENCH_ARGS:-}) \
      >"$out/$name-$in_flight-$round.log" 2>&1; then
    cp "$tree/benchmarks/results/bench_cuda_copy.json" "$out/$name-$in_flight-$round.json"
  else
    echo "$name, $in_flight in flight, round $round: failed (see its log)"
  fi
}
for in_flight in 4 1; do
  for round in $(seq "$rounds"); do
    bench "$base" base "$in_flight" "$round"
    bench "$PWD" new "$in_flight" "$round"
  done
done

"$py" - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, statistics, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    tree, in_flight, _ = path.stem.split("-")
    for checksum, figures in json.loads(path.read_text())["results"].items():
        for kind in ("save", "load"):
            runs.setdefault((int(in_flight), checksum, kind, tree), []).append(
                figures[f"{kind}_ratio"])
print("ratio to the bare copy, median of the rounds [each round]")
print(f"{'in flight':>9} {'checksums':>12} {'':>4}  {'base':>24}  {'new':>24}")
for in_flight, checksum, kind in sorted({key[:3] for key in runs}, reverse=True):
    cells = []
    for tree in ("base", "new"):
        got = runs.get((in_flight, checksum, kind, tree), [])
        cells.append(f"{statistics.median(got):.2f} {got}" if got else "-")
    print(f"{in_flight:>9} {checksum:>12} {kind:>4}  {cells[0]:>24}  {cells[1]:>24}")
PY
