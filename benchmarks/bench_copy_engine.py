"""The copy engine's CPU cost against a bare torch copy of the same blocks, in one process.

What a sidecar's copy threads spend on each batch, without the sockets and the event
loop around them: ``gather_and_seal`` (engine blocks into values, checksums sealed)
and ``verify_and_scatter`` (values verified, then copied into engine blocks), the copy
engine's own functions, on values reserved in a real embedded store, against the bare
copy (``torch.index_select`` / ``index_copy_`` per layer into a contiguous staging
matrix). Each rep moves other blocks and other values, as a sidecar's copies do, and
writes around the caches as the sidecar does into the embedded store's values and the
engine's blocks (streaming stores; the same copy through the caches is timed beside
it). The copies run in this thread and are timed as its CPU time
(``time.thread_time``), which other processes on a shared machine disturb far less than
wall time; the kinds of copy alternate, so drift hits them alike.

    python benchmarks/bench_copy_engine.py [--geometry 24x48x16 16x64x32] [--repeat 30]

A ratio is bare CPU over copy-engine CPU (1.0: as cheap as the bare copy), with
checksums on and off: the difference is what integrity costs. Results are also written
to benchmarks/results/bench_copy_engine.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import time
from collections.abc import Awaitable, Callable

import anyio
import torch
from bench_sidecar_throughput import Geometry, make_layout
from harness import median, write_results

from pipeline.backends.cpu_copy import CopyThreads, gather_and_seal, verify_and_scatter
from pipeline.backends.stores.embedded import EmbeddedStore
from pipeline.backends.threads import WorkerThreads
from pipeline.core.config import EmbeddedStoreConfig
from pipeline.core.geometry import StoreGroupGeometry, build_store_groups
from pipeline.core.layout import KVCacheLayout
from pipeline.core.runs import value_span

NUM_BLOCKS = 1024
FRESH_BYTES = 1 << 30
"""About what a rep's copies cycle through, on each side: more than a cache holds."""


def engine_geometry(g: Geometry, checksum: bool) -> StoreGroupGeometry:
    page = g.page_kib << 10
    layout = KVCacheLayout.from_dict(make_layout(g.layers, page))
    tensors = {layer: (torch.randint(0, 256, (NUM_BLOCKS, page), dtype=torch.uint8), 0)
               for layer in layout.groups[0].layers}
    (geometry,) = build_store_groups(layout, tensors, checksum=checksum)
    return geometry


async def cpu_ms(cases: dict[str, Callable[[], Awaitable[object]]],
                 repeat: int) -> dict[str, float]:
    """Each case's median CPU milliseconds in this thread, the cases alternating."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(repeat + 1):
        for name, case in cases.items():
            started = time.thread_time()
            await case()
            if index:  # the first round warms: page touches, allocator growth
                samples[name].append((time.thread_time() - started) * 1000)
    return {name: median(values) for name, values in samples.items()}


async def measure(g: Geometry, checksum: bool, repeat: int) -> dict[str, float]:
    """Each rep copies other blocks into other values, from a gigabyte or so of each: a
    sidecar's copies meet memory the caches do not hold, and so do these."""
    geometry = engine_geometry(g, checksum)
    size = geometry.stored_bytes
    batch = g.blocks_per_request
    sets = max(2, FRESH_BYTES // (batch * value_span(size)))
    ids = [(torch.randperm(NUM_BLOCKS - 1)[:batch] + 1) for _ in range(sets)]
    words = [segment.blocks.view(torch.int64) for segment in geometry.segments]
    staging = torch.zeros(sets, batch, geometry.value_bytes // 8, dtype=torch.int64)
    width = (g.page_kib << 10) // 8
    turn = {name: 0 for name in ("bare_gather", "gather", "gather_cached", "bare_scatter",
                                 "scatter", "scatter_cached")}

    def next_set(name: str) -> int:
        turn[name] += 1
        return turn[name] % sets

    async def bare_gather() -> None:
        k = next_set("bare_gather")
        for i, page in enumerate(words):
            torch.index_select(page, 0, ids[k], out=staging[k, :, i * width : (i + 1) * width])

    def into(k: int) -> torch.Tensor:
        """Where set k is loaded: other blocks than it was saved from, which the caches
        no longer hold, as a block an engine takes from its free queue."""
        return ids[(k + sets // 2) % sets]

    async def bare_scatter() -> None:
        k = next_set("bare_scatter")
        for i, page in enumerate(words):
            page.index_copy_(0, into(k), staging[k, :, i * width : (i + 1) * width])

    inline = CopyThreads(WorkerThreads(1, name="bench"), inline_bytes=1 << 62)  # in this thread
    capacity = sets * batch * value_span(size)
    async with EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=capacity)) as store:
        extents = [await store.reserve([f"k{k}-{i}" for i in range(batch)], size)
                   for k in range(sets)]
        runs = [e.runs for e in extents]

        def gather(name: str, stream: bool) -> Callable[[], Awaitable[None]]:
            async def case() -> None:
                k = next_set(name)
                await gather_and_seal(inline, geometry, ids[k].tolist(), runs[k],
                                      stream=stream)
            return case

        def scatter(name: str, stream: bool) -> Callable[[], Awaitable[None]]:
            async def case() -> None:
                k = next_set(name)
                intact = await verify_and_scatter(inline, geometry, into(k).tolist(),
                                                  runs[k], stream=stream)
                assert all(intact), "a value failed its checksum"
            return case

        # Every value sealed once before the scatters check them.
        for k in range(sets):
            await gather_and_seal(inline, geometry, ids[k].tolist(), runs[k])
        figures = await cpu_ms({
            "bare_gather": bare_gather, "gather": gather("gather", True),
            "gather_cached": gather("gather_cached", False),
            "bare_scatter": bare_scatter, "scatter": scatter("scatter", True),
            "scatter_cached": scatter("scatter_cached", False),
        }, repeat)
        for e in extents:
            store.commit(e, written=True)
    return figures


async def main_async(args: argparse.Namespace) -> None:
    rows = []
    print(f"CPU ms per batch, median of {args.repeat}; ratio = bare / copy engine; "
          "cached: the same copy with stores through the caches")
    print(f"{'geometry':>10} {'checksum':>8} {'bare save':>9} {'save':>7} {'ratio':>6} "
          f"{'cached':>7} {'bare load':>9} {'load':>7} {'ratio':>6} {'cached':>7}")
    for g in args.geometry:
        for checksum in (True, False):
            f = await measure(g, checksum, args.repeat)
            row = {"geometry": str(g), "checksum": "on" if checksum else "off", "cpu_ms": f,
                   "save_ratio": f["bare_gather"] / f["gather"],
                   "load_ratio": f["bare_scatter"] / f["scatter"]}
            rows.append(row)
            print(f"{g!s:>10} {row['checksum']:>8} {f['bare_gather']:9.2f} {f['gather']:7.2f} "
                  f"{row['save_ratio']:6.2f} {f['gather_cached']:7.2f} "
                  f"{f['bare_scatter']:9.2f} {f['scatter']:7.2f} {row['load_ratio']:6.2f} "
                  f"{f['scatter_cached']:7.2f}")
    by = {(r["geometry"], r["checksum"]): r for r in rows}
    for g in args.geometry:
        on, off = by[(str(g), "on")], by[(str(g), "off")]
        # Each against its own bare copy: the rows ran minutes apart on a shared machine.
        print(f"{g}: integrity costs {off['save_ratio'] / on['save_ratio'] - 1:+.0%} on "
              f"saves, {off['load_ratio'] / on['load_ratio'] - 1:+.0%} on loads "
              "(copy-engine CPU, each against its bare copy)")
    path = write_results("bench_copy_engine", {"args": {
        "geometry": [str(g) for g in args.geometry], "repeat": args.repeat}, "rows": rows})
    print(f"results: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", type=Geometry.parse, nargs="+",
                        default=[Geometry(24, 48, 16), Geometry(16, 64, 32)])
    parser.add_argument("--repeat", type=int, default=30)
    torch.set_num_threads(1)
    anyio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
