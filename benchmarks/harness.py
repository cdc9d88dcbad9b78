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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from pipeline.app.status import Buckets, Snapshot, read_metrics
from pipeline.testing import SidecarProcess, run_sidecar_process

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"


@contextlib.contextmanager
def spawned_sidecar(
    config: Path, *, profile: str = "", profile_out: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[SidecarProcess]:
    """A sidecar process on a fresh ipc:// endpoint (``.endpoint``); SIGTERMed on exit."""
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
            yield sidecar
        finally:
            if spy is not None and spy.poll() is None:
                spy.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.wait(timeout=60)
            code = sidecar.terminate(timeout_s=60)
            if code != 0:
                print(f"sidecar exited with {code}:\n{sidecar.log()[-4000:]}", file=sys.stderr)


async def run_requests(concurrency: int, calls: Sequence[Callable[[], Any]]) -> float:
    """Run the calls in order, ``concurrency`` in flight, as an engine keeps requests in
    flight: each of ``concurrency`` tasks makes the next call once its last has
    returned (one: this task alone, no hand-off between calls); wall seconds for all."""
    pending = iter(calls)

    async def caller() -> None:
        for call in pending:
            await call()

    started = time.perf_counter()
    if concurrency == 1:
        await caller()
    else:
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(caller)
    return time.perf_counter() - started


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds process ``pid``'s threads have run so far: its main thread's (a
    sidecar's event loop) and all the others' together (copy and store threads, ZMQ's,
    the log writer's). Read from Linux's per-thread scheduler statistics, which count
    nanoseconds (``/proc/PID/task/*/stat`` counts 10 ms ticks); NaN where they are
    missing."""
    main = others = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return math.nan, math.nan
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stats:
                seconds = int(stats.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread has exited, or the kernel keeps no such statistics
        if int(tid) == pid:
            main = seconds
        else:
            others += seconds
    return main, others


def checksum_cost(rows: Sequence[dict[str, Any]], by: Sequence[str], save: str, load: str
                  ) -> list[dict[str, Any]]:
    """What integrity costs, where both variants ran: GB/s with checksums on over off
    (``row["gbps"][save]`` and ``[load]``), by the values of the fields ``by`` of the
    rows (each with ``"checksum": "on"`` or ``"off"``), one entry each: those fields,
    ``save_on_over_off`` and ``load_on_over_off``. 1.0: integrity is free. Each is
    printed, the last of ``by`` as the requests in flight."""
    by_variant = {(*(row[name] for name in by), row["checksum"]): row["gbps"] for row in rows}
    costs = [
        {**dict(zip(by, key[:-1], strict=True)),
         "save_on_over_off": on[save] / off[save], "load_on_over_off": on[load] / off[load]}
        for key, on in by_variant.items()
        if key[-1] == "on" and (off := by_variant.get((*key[:-1], "off")))
    ]
    for cost in costs:
        where = ", ".join(str(cost[name]) for name in by)
        print(f"integrity at {where} in flight: checksums on / off = "
              f"{cost['save_on_over_off']:.2f} for saves, {cost['load_on_over_off']:.2f} "
              "for loads")
    return costs


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired(samples: Sequence[dict[str, Any]], baseline: str, measured: str) -> dict[str, float]:
    """Each round's own ratio, ``samples[i][baseline] / samples[i][measured]`` (seconds:
    the measured's throughput over the baseline's timed beside it in the same round),
    as ``median``, ``q1`` and ``q3`` over the rounds: on a noisy machine, drift between
    rounds moves both sides of a round alike, and the quartiles show what is left."""
    ratios = sorted(s[baseline] / s[measured] for s in samples)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3}


def paired_text(ratio: dict[str, float]) -> str:
    """A ``paired`` ratio as printed: median [q1-q3]."""
    return f"{ratio['median']:.2f} [{ratio['q1']:.2f}-{ratio['q3']:.2f}]"


def request_medians(log: str) -> dict[str, dict[str, float]]:
    """For each kind of request in (part of) a sidecar's log, the medians of its
    ``request.done`` lines, in ms after receipt: when each stage finished its part, and
    ``ms``, when the reply was handed to the socket. A log read while the sidecar writes
    it may end in part of a line, which is left out."""
    by_kind: dict[str, list[dict[str, float]]] = {}
    for done in _requests_done(log):
        by_kind.setdefault(done["kind"], []).append({**done["stages"], "ms": done["ms"]})
    return {kind: {name: round(median([done[name] for done in lines if name in done]), 3)
                   for name in dict.fromkeys(name for done in lines for name in done)}
            for kind, lines in by_kind.items()}


def reply_ms(log: str) -> dict[tuple[str, str], float]:
    """Each request in (part of) a sidecar's log, by kind and request id: ms from its
    receipt to its reply."""
    return {(done["kind"], done["request_id"]): done["ms"] for done in _requests_done(log)}


def _requests_done(log: str) -> Iterator[dict[str, Any]]:
    """The ``request.done`` lines of a log; one still being written is left out."""
    for line in log.splitlines(keepends=True):
        if '"request.done"' in line and line.endswith("\n"):
            yield json.loads(line)


def stage_times(inside: dict[str, float]) -> str:
    """One kind's ``request_medians``, as a line: each stage's end, then the reply."""
    return ", ".join(f"{stage} {ms}" for stage, ms in inside.items())


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank on sorted samples."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def scrape_histogram(metrics_url: str, name: str, **labels: str) -> Buckets:
    """The buckets of one labelled histogram, as a sidecar's /metrics shows them now."""
    return Snapshot(read_metrics(metrics_url, timeout_s=10)).buckets(name, **labels)


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }


def profile_path(name: str, profile: str) -> Path | None:
    """Where a sidecar's profile of kind ``profile`` goes (``spawned_sidecar``'s
    ``profile_out``), in the results folder under ``name``; None without a profile."""
    suffix = {"cprofile": "prof", "py-spy": "txt"}.get(profile)
    if suffix is None:
        return None
    RESULTS_DIR.mkdir(exist_ok=True)
    return RESULTS_DIR / f"{name}.{suffix}"


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
