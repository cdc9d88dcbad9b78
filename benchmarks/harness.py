"""Shared helpers of the sidecar benchmarks: a real sidecar process, timing, results.

The sidecar runs exactly as a user starts it (``kvsidecar serve``, through the project's one
launcher, ``pipeline.testing.run_sidecar_process``), in its own process, optionally under a
profiler:

- ``cprofile``: ``python -m cProfile -o FILE -m pipeline.app.cli serve ...``; the profile is
  written when SIGTERM ends the sidecar cleanly.
- ``py-spy``: ``py-spy record --pid`` attached to the running sidecar (sampling, so the
  sidecar runs at full speed); stopped with SIGINT, which makes it write its output.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
from prometheus_client.parser import text_string_to_metric_families

from pipeline.testing import run_sidecar_process

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"


@contextlib.contextmanager
def spawned_sidecar(
    config: Path, *, profile: str = "", profile_out: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """A sidecar process on a fresh ipc:// endpoint; yields the endpoint, SIGTERMs on exit."""
    python_args: list[str] = []
    if profile == "cprofile":
        assert profile_out is not None
        python_args = ["-m", "cProfile", "-o", str(profile_out)]
    with run_sidecar_process(config=config, python_args=python_args, env=env,
                             startup_timeout_s=60, stop_timeout_s=60) as sidecar:
        spy: subprocess.Popen[bytes] | None = None
        try:
            if profile == "py-spy":
                assert profile_out is not None
                spy = subprocess.Popen(
                    ["py-spy", "record", "--pid", str(sidecar.pid), "--rate", "250",
                     "--format", "raw", "--threads", "--output", str(profile_out)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                )
                time.sleep(1.0)  # let it attach before the measured work starts
                if spy.poll() is not None:
                    assert spy.stderr is not None
                    raise RuntimeError(f"py-spy failed: {spy.stderr.read().decode()[-2000:]}")
            yield sidecar.endpoint
        finally:
            if spy is not None and spy.poll() is None:
                spy.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.wait(timeout=60)
            code = sidecar.terminate(timeout_s=60)
            if code != 0:
                print(f"sidecar exited with {code}:\n{sidecar.log()[-4000:]}", file=sys.stderr)


async def run_requests(concurrency: int, calls: Sequence[Callable[[], Any]]) -> float:
    """Run the calls with at most ``concurrency`` in flight; wall seconds for all."""
    limiter = anyio.Semaphore(concurrency)

    async def one(call: Callable[[], Any]) -> None:
        async with limiter:
            await call()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(one, call)
    return time.perf_counter() - started


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank on sorted samples."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


Buckets = list[tuple[float, float]]
"""A Prometheus histogram: (upper bound, cumulative count), ascending, +Inf last."""


def scrape_histogram(metrics_url: str, name: str, **labels: str) -> Buckets:
    """The buckets of one labelled histogram, as a sidecar's /metrics shows them now."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    buckets = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(
                sample.labels.get(key) == value for key, value in labels.items()
            ):
                buckets.append((float(sample.labels["le"]), sample.value))
    return sorted(buckets)


def histogram_quantile(q: float, after: Buckets, before: Buckets | None = None) -> float:
    """The q-quantile (0..1) of what a histogram counted between two scrapes, linearly
    interpolated inside its bucket (as PromQL's histogram_quantile does). An empty
    ``before`` is a histogram that had counted nothing yet."""
    counts = [(bound, count - (before[i][1] if before else 0))
              for i, (bound, count) in enumerate(after)]
    total = counts[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
