"""The disk tier against bare I/O, the memory tier with it on and off, and a warm restart.

Three measurements, in one run, on a directory of the file system under test (``--dir``,
default: a fresh directory under /var/tmp):

1. **The tier's I/O.** Values written through the tier (records batched, encoded and
   checksummed, written and synced by its writers) against a bare write of the same
   bytes by the same method: ``pwrite`` of ``batch_bytes`` chunks from aligned memory,
   ``O_DIRECT`` where the file system allows, ``fdatasync`` after each, as many in
   flight as the tier has writers. Then every value read back through the tier (read,
   checked, copied out; two loads of 64 values in flight) against a bare ``preadv`` of
   the same records, as many in flight as the tier has readers. Ratio: tier GB/s over
   bare GB/s (goal: at least 0.8).
2. **The memory tier, disk on and off.** Saves (reserve, copy in, commit) and loads
   (lease, copy out, release) of the embedded store in this process, with a disk tier
   writing behind it and without, alternating rounds, with the process set up as a
   sidecar's is. Ratio: on over off (goal: 1 within noise). The tier's writers share the
   machine's cores with the saves, at a lower priority.
3. **Restart to the first hit.** A sidecar fills a tier of ``--restart-gib`` through
   engine saves and is stopped (SIGTERM); a second is started on it, and the time from
   its spawn to ready and to the first verified load is measured, then the hit rate over
   every prompt saved (goal: first hit within 5 s for a few GiB).

    python benchmarks/bench_disk_tier.py [--total-mib 1024] [--value-kib 256]
        [--rounds 3] [--restart-gib 2] [--dir DIR]

Results are also written to benchmarks/results/bench_disk_tier.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the test kit
from harness import median, write_results

from pipeline.app import process
from pipeline.backends.stores.disk import open_disk_tier
from pipeline.backends.stores.embedded import EmbeddedStore
from pipeline.core.config import DiskStoreConfig, EmbeddedStoreConfig
from pipeline.core.runs import value_views
from pipeline.core.store import ValueScope
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import KVEngine, random_tokens

MiB = 1 << 20
GiB = 1 << 30
SCOPE = ValueScope("bench", "0123456789abcdef")


def disk_config(path: Path, budget: int, **overrides: Any) -> DiskStoreConfig:
    settings: dict[str, Any] = {"path": str(path), "bytes": budget,
                                "segment_bytes": 256 * MiB, "max_queued_bytes": 256 * MiB}
    settings.update(overrides)
    return DiskStoreConfig(**settings)


def values_pool(value_bytes: int, count: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (value_bytes,), dtype=torch.uint8, generator=generator)
            for _ in range(count)]


# -- 1. the tier's I/O against bare I/O ------------------------------------------------


async def tier_io(path: Path, total: int, value_bytes: int) -> dict[str, float]:
    """Seconds to write ``total`` bytes of values through the tier, then to read them
    back, checked."""
    count = total // value_bytes
    pool = values_pool(value_bytes)
    config = disk_config(path, budget=2 * total + GiB, max_queued_bytes=total + GiB)
    async with open_disk_tier(config) as tier:
        started = time.perf_counter()
        for index in range(count):
            tier.offer(f"key-{index}", pool[index % len(pool)], SCOPE.tenant,
                       SCOPE.fingerprint, lambda written: None)
        assert await tier.flush(600) and len(tier.records) == count
        wrote = time.perf_counter() - started
        keys = [f"key-{index}" for index in range(count)]

        async def load(lane: int) -> None:
            """Every other batch of 64 values, as one of two loads in flight reads them."""
            out = [torch.empty(value_bytes, dtype=torch.uint8) for _ in range(64)]
            for first in range(lane * 64, count, 128):
                chunk = keys[first : first + 64]
                ok = await tier.read_into([(key, tier.records[key], out[i])
                                           for i, key in enumerate(chunk)])
                assert all(ok)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(load, 0)
            tg.start_soon(load, 1)
        read = time.perf_counter() - started
        spans = [(tier.records[key].offset, tier.records[key].span) for key in keys]
    return {"write_s": wrote, "read_s": read, "records": count,
            "record_bytes": sum(span for _, span in spans)}


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600)


def bare_io(path: Path, total: int, chunk: int, writers: int, record_bytes: int,
            records: int, readers: int) -> dict[str, float]:
    """Seconds for a bare write of ``total`` bytes in ``chunk`` writes (``writers`` in
    flight, each synced), and for a bare read of ``records`` records of
    ``record_bytes`` (``readers`` in flight)."""
    file = path / "bare"
    fd = _open_direct(file, os.O_RDWR | os.O_CREAT)
    os.posix_fallocate(fd, 0, total + chunk)
    buffers = [mmap.mmap(-1, chunk) for _ in range(writers)]
    for buffer in buffers:
        buffer.write(os.urandom(chunk))

    def write(index: int) -> None:
        os.pwrite(fd, buffers[index % writers], index * chunk)
        os.fdatasync(fd)

    with concurrent.futures.ThreadPoolExecutor(writers) as pool:
        started = time.perf_counter()
        list(pool.map(write, range(-(-total // chunk))))
        wrote = time.perf_counter() - started
    span = -(-record_bytes // 4096) * 4096
    reads = [mmap.mmap(-1, span) for _ in range(readers)]

    def read(index: int) -> None:
        os.preadv(fd, [reads[index % readers]], (index * span) % total // 4096 * 4096)

    with concurrent.futures.ThreadPoolExecutor(readers) as pool:
        started = time.perf_counter()
        list(pool.map(read, range(records)))
        read_s = time.perf_counter() - started
    os.close(fd)
    file.unlink()
    return {"write_s": wrote, "read_s": read_s}


# -- 2. the memory tier with the disk tier on and off ------------------------------------


async def memory_round(path: Path | None, value_bytes: int, total: int) -> dict[str, float]:
    """Seconds to save ``total`` bytes of values (8 per call) into a 512 MiB memory tier,
    then to load the last 256 MiB of them back, with a disk tier at ``path`` or none."""
    pool = values_pool(value_bytes)
    count = total // value_bytes
    batch = 8

    async def run(store: EmbeddedStore) -> dict[str, float]:
        started = time.perf_counter()
        for first in range(0, count, batch):
            keys = [f"key-{index}" for index in range(first, min(count, first + batch))]
            extents = await store.reserve(keys, value_bytes, scope=SCOPE)
            for view, index in zip(value_views(extents.runs), range(first, count),
                                   strict=False):
                view.copy_(pool[index % len(pool)])
            store.commit(extents, written=True)
            await anyio.lowlevel.checkpoint()
        saved = time.perf_counter() - started
        out = torch.empty(value_bytes, dtype=torch.uint8)
        last = list(range(count - (256 * MiB) // value_bytes, count))
        started = time.perf_counter()
        for first in range(0, len(last), batch):
            keys = [f"key-{index}" for index in last[first : first + batch]]
            extents = await store.lease(keys, value_bytes, scope=SCOPE)
            for view in value_views(extents.runs):
                out.copy_(view)
            store.release(extents)
        loaded = time.perf_counter() - started
        return {"save_s": saved, "load_s": loaded}

    memory = EmbeddedStoreConfig(capacity_bytes=512 * MiB)
    if path is None:
        store = EmbeddedStore(memory)
        try:
            return await run(store)
        finally:
            await store.aclose()
    shutil.rmtree(path, ignore_errors=True)
    async with open_disk_tier(disk_config(path, budget=4 * total,
                                          max_queued_bytes=64 * MiB)) as tier:
        store = EmbeddedStore(memory, disk=tier)
        try:
            timing = await run(store)
            timing["disk_written"] = tier.counters.writes
            timing["disk_skipped"] = tier.counters.skipped
            return timing
        finally:
            await store.aclose()


# -- 3. restart to the first hit --------------------------------------------------------


def restart_layout(page_bytes: int) -> dict[str, Any]:
    return {"model": "bench/disk", "groups": [{
        "kind": "full_attention", "block_size": 16, "page_bytes": page_bytes,
        "layers": ["layers.0", "layers.1"]}]}


async def restart(path: Path, gib: float) -> dict[str, float]:
    """Fill a tier of ``gib`` through a sidecar, stop it, and time the next one."""
    page = 256 * 1024
    layout = restart_layout(page)
    value = 2 * page + 8
    blocks = 8
    prompts = int(gib * GiB) // (value * blocks)
    overrides = {"store": {"capacity_bytes": 256 * MiB,
                           "disk": {"path": str(path), "bytes": int(gib * GiB) + GiB}},
                 "server": {"drain_timeout_s": 60.0}}
    saver = KVEngine(layout, num_blocks=blocks * 4 + 1)  # block 0 is vLLM's null block
    ids = [[list(range(1 + blocks * i, 1 + blocks * i + blocks))] for i in range(4)]

    def tokens(index: int) -> list[int]:
        return random_tokens(16 * blocks + 1, seed=90_000 + index)

    with run_sidecar_process(overrides, startup_timeout_s=120, stop_timeout_s=120,
                             metrics=True) as first:
        async with await saver.connect(first.endpoint) as client:
            stored = 0
            for index in range(prompts):
                stored += (await client.save(f"fill-{index}", tokens(index),
                                             ids[index % 4])).stored
                if index % 32 == 31:  # a disk that keeps up: every value becomes durable
                    while metric(first, "kvsidecar_disk_writes_total") < stored:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
        skipped = metric(first, "kvsidecar_disk_skipped_total")
        first.terminate(timeout_s=120)
    reader = KVEngine(layout, num_blocks=blocks + 1)
    spawned = time.perf_counter()
    with run_sidecar_process(overrides, startup_timeout_s=120) as second:
        ready = time.perf_counter() - spawned
        async with await reader.connect(second.endpoint) as client:
            hit = await client.lookup(tokens(prompts - 1))
            loaded = await client.load("first", tokens(prompts - 1),
                                       [list(range(1, blocks + 1))], hit)
            first_hit = time.perf_counter() - spawned
            assert loaded.loaded_tokens == hit == 16 * blocks and not loaded.invalid_block_ids
            assert all(reader.same_block(0, 1 + j, saver, ids[(prompts - 1) % 4][0][j])
                       for j in range(blocks))
            hits = 0
            for index in range(prompts):
                hits += await client.lookup(tokens(index)) == 16 * blocks
        log = second.log()
    opened = next((line for line in log.splitlines() if "store.disk.opened" in line), "")
    return {"tier_gib": prompts * blocks * value / GiB, "prompts": prompts,
            "skipped_values": skipped, "ready_s": ready, "first_hit_s": first_hit,
            "hit_rate": hits / prompts, "opened_log": opened[:300]}


def metric(sidecar: SidecarProcess, name: str) -> float:
    return sum(sample.value for sample in sidecar.metrics() if sample.name == name)


def report(name: str, tier: float, bare: float, unit_bytes: int) -> str:
    return (f"{name}: tier {unit_bytes / tier / GiB:.2f} GiB/s, bare "
            f"{unit_bytes / bare / GiB:.2f} GiB/s, ratio {bare / tier:.2f}")


async def main(args: argparse.Namespace) -> None:
    process.for_serving()  # torch single-threaded, a short GIL switch: as a sidecar runs
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvsidecar-disk-",
                                                                 dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    total = args.total_mib * MiB
    value_bytes = args.value_kib * 1024
    results: dict[str, Any] = {"total_bytes": total, "value_bytes": value_bytes,
                               "dir": str(base)}
    try:
        io_rounds: list[dict[str, float]] = []
        for round_ in range(args.rounds):
            path = base / f"io-{round_}"
            tier = await tier_io(path, total, value_bytes)
            shutil.rmtree(path)
            bare = await anyio.to_thread.run_sync(
                bare_io, base, total, 8 * MiB, 2, tier["record_bytes"] // tier["records"],
                int(tier["records"]), 4)
            io_rounds.append({"tier_write_s": tier["write_s"], "tier_read_s": tier["read_s"],
                              "bare_write_s": bare["write_s"], "bare_read_s": bare["read_s"],
                              "write_ratio": bare["write_s"] / tier["write_s"],
                              "read_ratio": bare["read_s"] / tier["read_s"]})
            print(report("write", tier["write_s"], bare["write_s"], total), "|",
                  report("read", tier["read_s"], bare["read_s"], total), flush=True)
        results["io"] = io_rounds
        results["write_ratio_median"] = median([r["write_ratio"] for r in io_rounds])
        results["read_ratio_median"] = median([r["read_ratio"] for r in io_rounds])
        memory: list[dict[str, float]] = []
        for _ in range(args.rounds):
            off = await memory_round(None, value_bytes, total)
            on = await memory_round(base / "memory", value_bytes, total)
            memory.append({"save_ratio": off["save_s"] / on["save_s"],
                           "load_ratio": off["load_s"] / on["load_s"],
                           "off": off, "on": on})
            print(f"memory tier, disk on/off: saves {off['save_s'] / on['save_s']:.2f}, "
                  f"loads {off['load_s'] / on['load_s']:.2f} (on: {on['disk_written']:.0f} "
                  f"written, {on['disk_skipped']:.0f} skipped)", flush=True)
        results["memory"] = memory
        results["memory_save_ratio_median"] = median([r["save_ratio"] for r in memory])
        results["memory_load_ratio_median"] = median([r["load_ratio"] for r in memory])
        if args.restart_gib > 0:
            results["restart"] = await restart(base / "restart", args.restart_gib)
            print("restart:", {k: v for k, v in results["restart"].items()
                               if k != "opened_log"}, flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(f"medians: write {results['write_ratio_median']:.2f}, read "
          f"{results['read_ratio_median']:.2f}, memory saves "
          f"{results['memory_save_ratio_median']:.2f}, loads "
          f"{results['memory_load_ratio_median']:.2f}")
    print(write_results("bench_disk_tier", results))


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--value-kib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--restart-gib", type=float, default=2.0)
    parser.add_argument("--dir", default="")
    return parser.parse_args(argv)


if __name__ == "__main__":
    anyio.run(main, parse())
