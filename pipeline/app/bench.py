"""``kvsidecar bench [--quick]``: the benchmark suite, with progress bars, into a report.

Each benchmark script in ``benchmarks/`` runs as its own process (as a user runs it)
and writes its results; this command then writes ``bench-results/``: ``report.json``
(every figure, the config, the git revision and the machine), a PNG plot per benchmark
and ``summary.md``, the table of ratios against their goals. A benchmark missing its
goal is reported, not an error; one that fails to produce results is.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.app.bench_report import markdown_table, ratios, write_plots
from pipeline.core.config import load_config
from pipeline.core.errors import KVSidecarError

__all__ = ["Step", "git_revision", "machine_info", "run_bench", "steps"]

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
QUICK_STORE_BYTES = 128 * 2**20
"""The quick run's embedded store: small enough to fill (steady state) in a second."""


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    """The results file the script writes (``benchmarks/results/NAME.json``)."""
    script: str
    args: tuple[str, ...]
    title: str


def steps(*, quick: bool, config: Path) -> list[Step]:
    """The suite: throughput against batch size, lookup latency, overload."""
    throughput: tuple[str, ...]
    lookup: tuple[str, ...]
    soak: tuple[str, ...]
    if quick:
        throughput = ("--geometry", "8x48x4", "8x48x8", "8x48x16", "8x48x32", "--requests",
                      "4", "--concurrency", "4", "--checksum", "on", "--repeat", "3",
                      "--engine-blocks", "512")
        lookup = ("--tokens", "1024", "4096", "--calls", "40", "--repeat", "3")
        soak = ("--seconds", "20", "--engines", "2", "--calibrate-seconds", "2",
                "--unloaded-probes", "20", "--engine-startup-s", "4")
    else:
        throughput = ("--geometry", "24x48x4", "24x48x8", "24x48x16", "24x48x32", "24x48x64",
                      "--requests", "4", "--engine-blocks", "1024")
        lookup = ()
        soak = ("--seconds", "60")
    return [
        Step("bench_sidecar_throughput", "bench_sidecar_throughput.py",
             (*throughput, "--config", str(config)), "throughput against batch size"),
        Step("bench_lookup_latency", "bench_lookup_latency.py", (*lookup, "--config", str(config)),
             "lookup latency"),
        Step("soak", "soak.py", soak, "memory and load latency under overload"),
    ]


def _run_step(step: Step, scripts: Path, log: Path, progress: Progress,
              task: Any) -> tuple[int, float]:
    """Run one benchmark of ``scripts``, its output to ``log`` and its last line to the
    progress bar."""
    started = time.monotonic()
    with log.open("w") as out, subprocess.Popen(
        [sys.executable, str(scripts / step.script), *step.args], cwd=scripts.parent,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            if line.strip():
                progress.update(task, description=f"{step.title}: {line.strip()[:70]}")
    return process.returncode, time.monotonic() - started


def git_revision() -> str:
    """The checkout's short revision, ``-dirty`` with uncommitted changes."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  check=False).stdout.strip()
        except OSError:  # no git here
            return ""

    revision = git("rev-parse", "--short", "HEAD") or "unknown"
    return f"{revision}-dirty" if git("status", "--porcelain", "--untracked-files=no") else revision


def machine_info() -> dict[str, Any]:
    """This machine's CPU model and count, memory, platform, Python and torch."""
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    import torch

    return {"cpu": model, "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}


def run_bench(*, quick: bool, out: Path, config: Path | None = None,
              console: Console | None = None, scripts: Path = BENCHMARKS) -> int:
    """Run the suite (the benchmark ``scripts`` of the checkout, which write their results
    to ``scripts/results``) and write the report into ``out``; 0 when every benchmark
    produced results. Paths given relative are to the working directory."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise KVSidecarError("kvsidecar bench draws its plots with matplotlib: "
                             "pip install 'kvsidecar[bench]'") from exc
    if not scripts.is_dir():
        raise KVSidecarError(f"kvsidecar bench runs the scripts in {scripts}, which is not "
                             "there: run it from a source checkout")
    console = console or Console()
    out = out.resolve()  # the scripts run in the checkout, not here
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(config or DEFAULT_CONFIG)
    if quick:
        embedded = msgspec.structs.replace(base.store.embedded,
                                           capacity_bytes=QUICK_STORE_BYTES)
        base = msgspec.structs.replace(
            base, store=msgspec.structs.replace(base.store, embedded=embedded))
    config_path = out / "config.yaml"
    config_path.write_bytes(msgspec.yaml.encode(base))
    suite = steps(quick=quick, config=config_path)
    benchmarks: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    started = time.time()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console) as progress:
        overall = progress.add_task("kvsidecar bench" + (" --quick" if quick else ""),
                                    total=len(suite))
        for step in suite:
            task = progress.add_task(step.title, total=1)
            result = scripts / "results" / f"{step.name}.json"
            before = result.stat().st_mtime if result.exists() else 0.0
            code, seconds = _run_step(step, scripts, out / f"{step.name}.log", progress, task)
            fresh = result.exists() and result.stat().st_mtime > before
            runs[step.name] = {"exit_code": code, "seconds": round(seconds, 1),
                               "args": list(step.args), "produced_results": fresh}
            if fresh:
                benchmarks[step.name] = json.loads(result.read_text())
            progress.update(task, completed=1, description=(
                f"{step.title}: {'done' if fresh else 'FAILED'} in {seconds:.0f} s"))
            progress.advance(overall)

    found = ratios(benchmarks)
    machine = machine_info()
    revision = git_revision()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    heading = (f"Measured {date} on {machine['cpus']} CPUs ({machine['cpu']}, "
               f"{machine['memory_gib']} GiB), revision {revision}"
               f"{', --quick' if quick else ''}; medians, ratios against a baseline measured "
               "in the same run.")
    report = {
        "date": date, "started_unix": started, "quick": quick, "revision": revision,
        "machine": machine, "config": msgspec.to_builtins(base), "runs": runs,
        "ratios": [{**dataclasses.asdict(r), "met": r.met} for r in found],
        "benchmarks": benchmarks,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "summary.md").write_text(markdown_table(found, heading))
    plots = write_plots(benchmarks, out)

    table = Table(title=heading, title_justify="left")
    for column in ("measured", "ratio", "goal", "met"):
        table.add_column(column)
    for r in found:
        table.add_row(r.what, f"{r.value:.2f}", r.goal, "yes" if r.met else "[red]no[/red]")
    console.print(table)
    console.print(f"report: {out / 'report.json'}; plots: "
                  + ", ".join(str(p.name) for p in plots))
    failed = [name for name, run in runs.items() if not run["produced_results"]]
    if failed:
        console.print(f"[red]no results from {', '.join(failed)}[/red]: see "
                      + ", ".join(str(out / f"{name}.log") for name in failed))
        return 1
    return 0
