#!/usr/bin/env bash
# The quick benchmark suite (throughput, lookup latency, soak) over several trees in one
# run, alternated ROUNDS times on this machine; then each ratio's median and range per
# tree.
#
#   git archive REV | (mkdir -p .base && tar -x -C .base)     (here, before the run)
#   benchmarks/ab.sh OUT_DIR ROUNDS base=.base new=.          (5 rounds are the custom)
#
# Each tree's C extensions are built in place; each runs with its own packages first on
# PYTHONPATH, under this checkout's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mkdir -p "$1" && cd "$1" && pwd)"
rounds="$2"
shift 2
py="$PWD/.venv/bin/python"
names=()
declare -A trees
for spec in "$@"; do
  name="${spec%%=*}"
  trees[$name]="$(cd "${spec#*=}" && pwd)"
  names+=("$name")
  if ! (cd "${trees[$name]}" && "$py" -c 'from setuptools import setup; setup()' \
        build_ext --inplace -q) >"$out/build-$name.log" 2>&1; then
    tail -40 "$out/build-$name.log"
    exit 1
  fi
done

for round in $(seq "$rounds"); do
  for name in "${names[@]}"; do
    tree="${trees[$name]}"
    if ! (cd "$tree" && PYTHONPATH="$tree" "$py" -m pipeline.app.cli bench --quick \
          --out "$out/$name-$round") >"$out/$name-$round.log" 2>&1; then
      echo "$name, round $round: failed (see $out/$name-$round.log)"
    fi
  done
done

"$py" - "$out" "${names[@]}" <<'PY' | tee "$out/summary.txt"
import json, pathlib, re, statistics, sys
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs: dict[tuple[str, str], list[float]] = {}
order: list[str] = []
for name in names:
    for path in sorted(out.glob(f"{name}-*/report.json")):
        for ratio in json.loads(path.read_text())["ratios"]:
            what = re.sub(r"under [\d.]+x", "under overload", ratio["what"])
            if what not in order:
                order.append(what)
            runs.setdefault((what, name), []).append(ratio["value"])
print("median [min, max] of the rounds, per tree:", ", ".join(names))
for what in order:
    print(what)
    for name in names:
        got = runs.get((what, name), [])
        cell = (f"{statistics.median(got):6.2f} [{min(got):.2f}, {max(got):.2f}]"
                if got else "-")
        print(f"  {name:>8} {cell}")
PY
