"""MooncakeStore against raw Mooncake batch calls on the same client, in the same run.

Starts an embedded ``mooncake_master`` on loopback, registers one staging buffer, then
for each repetition moves N blocks through ``MooncakeStore.put`` / ``get_into`` and the
same bytes through the raw client's ``batch_put_from`` / ``batch_get_into`` (called
directly, no thread hop: the strictest baseline). The order alternates between
repetitions; keys are removed between them so every put lands in free space. Prints
median throughput and the ratio store/raw (goal: >= 0.9).

    python benchmarks/bench_mooncake_store.py --blocks 64 --block-kib 512 --reps 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio
import torch
from mooncake.store import ReplicateConfig

from pipeline.backends.stores.mooncake.setup import open_mooncake_store
from pipeline.backends.stores.mooncake.store import MooncakeStore
from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.outcomes import LOADED, STORED

MIB = 1024 * 1024


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


async def run(blocks: int, block_bytes: int, reps: int, warmup: int) -> None:
    batch_bytes = blocks * block_bytes
    segment = max(64 * MIB, 4 * batch_bytes)
    config = MooncakeStoreConfig(global_segment_bytes=segment, local_buffer_bytes=0)
    async with await open_mooncake_store(config) as store:
        raw = store.raw_client
        replicate = ReplicateConfig()
        replicate.replica_num = config.replica_num
        staging = torch.randint(0, 256, (2 * batch_bytes,), dtype=torch.uint8)
        await store.register_buffer(staging)
        sources = [staging[i * block_bytes : (i + 1) * block_bytes] for i in range(blocks)]
        targets = [
            staging[batch_bytes + i * block_bytes : batch_bytes + (i + 1) * block_bytes]
            for i in range(blocks)
        ]
        src_ptrs = [view.data_ptr() for view in sources]
        dst_ptrs = [view.data_ptr() for view in targets]
        sizes = [block_bytes] * blocks

        times: dict[str, list[float]] = {
            "store put": [],
            "raw put": [],
            "store get": [],
            "raw get": [],
        }
        for rep in range(-warmup, reps):  # negative: warm-up, touches segment pages
            store_keys = [f"bench-store-{rep}-{i}" for i in range(blocks)]
            raw_keys = [f"bench-raw-{rep}-{i}" for i in range(blocks)]

            async def store_put(keys: list[str] = store_keys) -> None:
                assert await store.put(keys, sources) == [STORED] * blocks

            async def raw_put(keys: list[str] = raw_keys) -> None:
                assert raw.batch_put_from(keys, src_ptrs, sizes, replicate) == [0] * blocks

            async def store_get(keys: list[str] = store_keys) -> None:
                assert await store.get_into(keys, targets) == [LOADED] * blocks

            async def raw_get(keys: list[str] = raw_keys) -> None:
                assert raw.batch_get_into(keys, dst_ptrs, sizes) == sizes

            pairs = [("store", store_put, store_get), ("raw", raw_put, raw_get)]
            for name, put, get in pairs if rep % 2 == 0 else reversed(pairs):
                put_s = await timed(put)
                received = staging[batch_bytes:].zero_()
                get_s = await timed(get)
                assert torch.equal(received, staging[:batch_bytes])
                if rep >= 0:
                    times[f"{name} put"].append(put_s)
                    times[f"{name} get"].append(get_s)
            # Force: the puts' and gets' leases would keep the objects for a while.
            raw.batch_remove(store_keys + raw_keys, True)
        report(times, batch_bytes, blocks, block_bytes, reps, store)


def report(
    times: dict[str, list[float]],
    batch_bytes: int,
    blocks: int,
    block_bytes: int,
    reps: int,
    store: MooncakeStore,
) -> None:
    print(
        f"\nMooncakeStore vs raw batch calls: {blocks} blocks x {block_bytes // 1024} KiB "
        f"= {batch_bytes / MIB:.0f} MiB per batch, {reps} repetitions, master "
        f"{store.master_address}, tcp on loopback"
    )
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, seconds in medians.items():
        rate = batch_bytes / seconds / 1e9
        print(f"  {name:10s} median {seconds * 1e3:8.2f} ms  {rate:6.2f} GB/s")
    for op in ("put", "get"):
        ratio = medians[f"raw {op}"] / medians[f"store {op}"]
        # Each repetition times both back to back: their ratio cancels load drift.
        paired = statistics.median(
            raw / mine for raw, mine in zip(times[f"raw {op}"], times[f"store {op}"], strict=True)
        )
        verdict = "ok" if min(ratio, paired) >= 0.9 else "below goal"
        print(
            f"  {op}: store/raw throughput ratio {ratio:.3f} of medians, {paired:.3f} median "
            f"of paired repetitions (goal >= 0.9: {verdict})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    anyio.run(run, args.blocks, args.block_kib * 1024, args.reps, args.warmup)


if __name__ == "__main__":
    main()
