"""``kvsidecar demo``: one sidecar, two simulated engine processes, every byte verified.

The engines share a pool of long prefixes; each request looks up, loads what the store
has (checking every loaded block against what the other engine must have saved), fills
the rest and saves it. The sidecar and each engine are separate processes talking over
a real ipc:// socket and real shared memory, as in production.

The second engine starts once the first has answered its first request, which opens
with the prefix every engine's first request shares; so the second engine loads what the
first saved whatever the number of requests, and the demo fails if it does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.app.engine_sim import SimReport
from pipeline.app.launcher import run_sidecar_process

__all__ = ["run_demo"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
"""The checkout's default config; it holds exactly the built-in defaults, which an
installed package without the checkout runs with instead."""
DEMO_BLOCK_SIZE = 32
"""The preset's 800-token blocks scaled down so the demo runs in seconds."""
ENGINES = ("engine-a", "engine-b")
CONCURRENCY = 4
"""Requests each engine keeps in flight."""


async def _run_engines(
    endpoint: str, args: argparse.Namespace, console: Console
) -> list[SimReport]:
    reports: list[SimReport] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        first_answered = anyio.Event()

        async def engine(index: int, engine_id: str) -> None:
            task = progress.add_task(engine_id, total=args.requests)
            if index > 0:
                await first_answered.wait()
            command = [
                sys.executable,
                "-m",
                "pipeline.app.cli",
                "engine-sim",
                "--endpoint",
                endpoint,
                "--layout",
                args.layout,
                "--engine-id",
                engine_id,
                "--requests",
                str(args.requests),
                "--seed",
                str(index + 1),
                "--concurrency",
                str(CONCURRENCY),
                "--block-scale",
                str(DEMO_BLOCK_SIZE),
                "--json",
            ]
            async with await anyio.open_process(command, stderr=None) as process:
                assert process.stdout is not None
                buffered = b""
                async for chunk in process.stdout:
                    buffered += chunk
                    *lines, buffered = buffered.split(b"\n")
                    for line in lines:
                        event = json.loads(line)
                        if "done" in event:
                            progress.update(task, completed=event["done"])
                            if index == 0 and event["request"] == 0:
                                first_answered.set()
                        else:
                            reports.append(SimReport(**event["report"]))
                await process.wait()
            first_answered.set()

        async with anyio.create_task_group() as tg:
            for index, engine_id in enumerate(ENGINES):
                tg.start_soon(engine, index, engine_id)
    return reports


def _summary(total: SimReport, wall_s: float, sidecar_exit: int) -> Table:
    table = Table(title="kvsidecar demo", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    hit_rate = total.hit_tokens / total.lookup_tokens if total.lookup_tokens else 0.0
    rows = [
        ("engines", str(len(ENGINES))),
        ("requests", str(total.requests)),
        ("prefix hit rate (tokens)", f"{hit_rate:.1%}"),
        ("blocks stored", str(total.blocks_stored)),
        ("blocks deduplicated (already present)", str(total.blocks_present)),
        ("blocks skipped (partial tail, overload)", str(total.blocks_skipped)),
        ("blocks failed", str(total.blocks_failed)),
        ("blocks loaded", str(total.blocks_loaded)),
        ("blocks verified byte-exact", f"{total.blocks_verified}/{total.blocks_loaded}"),
        ("GB moved (saved + loaded)", f"{(total.bytes_saved + total.bytes_loaded) / 1e9:.3f}"),
        (
            "save throughput (GB/s per request)",
            f"{total.bytes_saved / total.save_seconds / 1e9:.2f}" if total.save_seconds else "-",
        ),
        (
            "load throughput (GB/s per request)",
            f"{total.bytes_loaded / total.load_seconds / 1e9:.2f}" if total.load_seconds else "-",
        ),
        ("ring blocks ignored", str(total.ring_blocks_ignored)),
        ("errors", str(total.errors + total.blocks_mismatched)),
        ("sidecar exit code", str(sidecar_exit)),
        ("wall time (s)", f"{wall_s:.1f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def run_demo(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    started = time.perf_counter()
    with run_sidecar_process(config=config, env={"NO_COLOR": "1"},
                             stop_timeout_s=30) as sidecar:
        try:
            console.print(
                f"sidecar up at {sidecar.endpoint}; engines use layout {args.layout!r} "
                f"with blocks scaled to {DEMO_BLOCK_SIZE} tokens"
            )
            reports = anyio.run(_run_engines, sidecar.endpoint, args, console)
        finally:
            sidecar_exit = sidecar.terminate(timeout_s=30)
        sidecar_log = sidecar.log()
    wall_s = time.perf_counter() - started
    total = SimReport()
    for report in reports:
        total.merge(report)
    console.print(_summary(total, wall_s, sidecar_exit))
    ok = (
        len(reports) == len(ENGINES)
        and total.errors == 0
        and total.blocks_mismatched == 0
        and total.blocks_verified == total.blocks_loaded
        and total.blocks_loaded > 0
        and sidecar_exit == 0
    )
    if not ok:
        console.print("[red]demo FAILED[/red]; sidecar log follows")
        console.print(sidecar_log[-4000:])
        return 1
    console.print("[green]every loaded byte verified[/green]")
    return 0
