#!/usr/bin/env bash
# The quick benchmark suite (throughput, lookup latency, soak) A/B in one run: this tree
# against another, alternated ROUNDS times on this machine, then each ratio's median and
# range per tree.
#
#   git archive REV | (mkdir -p .base && tar -x -C .base)     (here, before the run)
#   benchmarks/ab.sh .base [OUT_DIR] [ROUNDS]      (default: bench-results/ab, 5)
#
# The other tree's C extensions are built in place; each tree runs with its own
# packages first on PYTHONPATH, under this checkout's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
base="$(cd "$1" && pwd)"
out="$(mkdir -p "${2:-bench-results/ab}" && cd "${2:-bench-results/ab}" && pwd)"
rounds="${3:-5}"
py="$PWD/.venv/bin/python"
if ! (cd "$base" && "$py" -c 'from setuptools import setup; setup()' build_ext --inplace -q) \
    >"$out/build-base.log" 2>&1; then
  tail -40 "$out/build-base.log"
  exit 1
fi

suite() {  # TREE NAME ROUND
  local tree=$1 name=$2 round=$3
  if ! (cd "$tree" && PYTHONPATH="$tree" "$py" -m pipeline.app.cli bench --quick \
        --out "$out/$name-$round") >"$out/$name-$round.log" 2>&1; then
    echo "$name, round $round: failed (see $out/$name-$round.log)"
  fi
}
for round in $(seq "$rounds"); do
  suite "$base" base "$round"
  suite "$PWD" new "$round"
done

"$py" - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, statistics, sys
runs: dict[tuple[str, str], list[float]] = {}
order: list[str] = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*-*/report.json")):
    tree = path.parent.name.split("-")[0]
    for ratio in json.loads(path.read_text())["ratios"]:
        if ratio["what"] not in order:
            order.append(ratio["what"])
        runs.setdefault((ratio["what"], tree), []).append(ratio["value"])
print("median [min, max] of the rounds, per tree")
for what in order:
    cells = []
    for tree in ("base", "new"):
        got = runs.get((what, tree), [])
        cells.append(f"{statistics.median(got):6.2f} [{min(got):.2f}, {max(got):.2f}]"
                     if got else "-")
    print(f"{what[:78]:<78}  {cells[0]:>20}  {cells[1]:>20}")
PY
