"""Save and load throughput through a real sidecar on Mooncake against raw Mooncake batch calls.

This process starts a ``mooncake_master`` on loopback (tcp), sets up a raw
``mooncake.store.MooncakeDistributedStore`` against it (same segment size as the
sidecar's), and spawns sidecars (``python -m pipeline.app.cli serve``) whose config is
``--config`` pointed at that same master: values moved in place
(straight between engine memory and the store, ``store.mooncake.in_place``) and through
staging, each with ``store.checksum`` on and off. It plays the engine: KV tensors in
shared memory, fresh token ids every round (nothing is deduplicated). Each repetition,
in alternating order:

- each sidecar: ``save`` a fresh round's requests, then ``load`` them into other engine
  blocks;
- raw: ``batch_put_from`` of the same number of values of the same size (one call per
  request, from a registered buffer), then ``batch_get_into`` of them back.

All the sidecars run at once, and each repetition takes turns in a rotated order, so
that every variant and the raw calls are measured in the same stretch of time.

Both land in the same cluster (the sidecar's segment and the raw client's, placed by the
master). Every object is removed (forced) after each repetition, so every put lands in
free space. The raw calls are the floor of what the sidecar must do; its extra work is
the existence checks, hashing, checksums and the socket, and through staging the
engine <-> staging copies.

    python benchmarks/bench_mooncake_sidecar.py [--layers 8] [--page-kib 64]
        [--requests 8] [--blocks-per-request 8] [--concurrency 1 4] [--repeat 7]
        [--in-place on off] [--checksum on off] [--config configs/mooncake.yaml]
        [--profile {cprofile,py-spy}]

Ratios are sidecar GB/s over raw GB/s (goal: >= 0.9). Results are also written to
benchmarks/results/bench_mooncake_sidecar.json.
"""

from __future__ import annotations

import os

# See bench_sidecar_throughput.py: idle OpenMP threads must not spin on a small machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import dataclasses
import itertools
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import torch
from bench_sidecar_throughput import Engine, Workload, make_layout, run_requests, sidecar_config
from harness import RESULTS_DIR, ROOT, median, spawned_sidecar, write_results

from pipeline.core.config import Config, MooncakeStoreConfig, load_config
from pipeline.core.integrity import CHECKSUM_BYTES
from pipeline.core.outcomes import BlockStatus
from transport.client import EngineClient
from transport.mooncake_master import EmbeddedMaster, open_embedded_master
from transport.mooncake_setup import replicate

GOAL = 0.9
DEFAULT_CONFIG = ROOT / "configs" / "mooncake.yaml"


class RawClient:
    """A raw Mooncake client on the same master, with one registered buffer of two halves."""

    def __init__(self, config: MooncakeStoreConfig, master: EmbeddedMaster, round_bytes: int):
        import mooncake.store

        self.client = mooncake.store.MooncakeDistributedStore()
        rc = self.client.setup(
            local_hostname=config.local_hostname,
            metadata_server=master.endpoints.metadata_server,
            global_segment_size=config.global_segment_bytes,
            local_buffer_size=config.local_buffer_bytes,
            protocol=config.protocol,
            rdma_devices=config.device_name,
            master_server_addr=master.endpoints.master_address,
        )
        if rc != 0:
            raise RuntimeError(f"raw mooncake setup failed with code {rc}")
        self.replicate = replicate(mooncake.store, config, self.client)  # as the sidecar's
        self.round_bytes = round_bytes
        self.buffer = torch.randint(0, 256, (2 * round_bytes,), dtype=torch.uint8)
        rc = self.client.register_buffer(self.buffer.data_ptr(), self.buffer.numel())
        if rc != 0:
            raise RuntimeError(f"raw mooncake register_buffer failed with code {rc}")

    def calls(
        self,
        prefix: str,
        requests: int,
        blocks: int,
        value_bytes: int,
    ) -> tuple[list[Callable[[], None]], list[Callable[[], None]]]:
        """One batch_put_from and one batch_get_into per request, over fresh keys."""
        puts, gets = [], []
        for r in range(requests):
            keys = [f"raw-{prefix}-{r}-{i}" for i in range(blocks)]
            first = r * blocks * value_bytes
            src = [self.buffer.data_ptr() + first + i * value_bytes for i in range(blocks)]
            dst = [p + self.round_bytes for p in src]
            sizes = [value_bytes] * blocks

            def put(
                keys: list[str] = keys,
                src: list[int] = src,
                sizes: list[int] = sizes,
            ) -> None:
                codes = self.client.batch_put_from(keys, src, sizes, self.replicate)
                if codes != [0] * len(keys):
                    raise RuntimeError(f"raw batch_put_from: {sorted(set(codes))}")

            def get(
                keys: list[str] = keys,
                dst: list[int] = dst,
                sizes: list[int] = sizes,
            ) -> None:
                codes = self.client.batch_get_into(keys, dst, sizes)
                if codes != sizes:
                    raise RuntimeError(f"raw batch_get_into: {sorted(set(codes))}")

            puts.append(put)
            gets.append(get)
        return puts, gets

    def same_halves(self, used: int) -> bool:
        return torch.equal(
            self.buffer[:used], self.buffer[self.round_bytes : self.round_bytes + used]
        )

    def close(self) -> None:
        self.client.close()


async def run_raw(concurrency: int, calls: Sequence[Callable[[], None]]) -> float:
    """Wall seconds for the calls, ``concurrency`` at a time (worker threads when > 1)."""
    if concurrency == 1:  # called directly, no thread hop: the strictest baseline
        started = time.perf_counter()
        for call in calls:
            call()
        return time.perf_counter() - started
    limiter = anyio.CapacityLimiter(concurrency)
    return await run_requests(
        concurrency,
        [lambda call=call: anyio.to_thread.run_sync(call, limiter=limiter) for call in calls],
    )


@dataclasses.dataclass
class Sidecar:
    """One variant's sidecar as this engine's client sees it."""

    name: str
    client: EngineClient
    stored_bytes: int
    workload: Workload


async def sidecar_side(
    sidecar: Sidecar, engine: Engine, concurrency: int, *, verify: bool
) -> tuple[float, float]:
    """Save a fresh round through ``sidecar``, then load it into other blocks: seconds
    for each."""
    tokens, src, dst, prefix = sidecar.workload.next_round()
    client = sidecar.client
    problems: list[str] = []

    async def save(r: int) -> None:
        result = await client.save(f"{prefix}-{r}", tokens[r], [src[r]])
        if result.stored != len(src[r]):
            reasons = sorted(
                {b.reason or "" for b in result.blocks if b.status is not BlockStatus.STORED}
            )
            problems.append(
                f"save {r}: {result.stored} stored, {result.present} present, "
                f"{result.skipped} skipped, {result.failed} failed {reasons}"
            )

    async def load(r: int) -> None:
        result = await client.load(f"{prefix}-{r}", tokens[r], [dst[r]], len(tokens[r]))
        loaded = sum(1 for b in result.blocks if b.status is BlockStatus.LOADED)
        if loaded != len(dst[r]):
            problems.append(f"load {r}: {loaded}/{len(dst[r])} loaded")

    calls = range(sidecar.workload.requests)
    saved = await run_requests(concurrency, [lambda r=r: save(r) for r in calls])
    loaded = await run_requests(concurrency, [lambda r=r: load(r) for r in calls])
    if problems:
        raise RuntimeError(f"{sidecar.name}: " + "; ".join(problems[:4]))
    if verify:
        for r in calls:
            for a, b in zip(src[r], dst[r], strict=True):
                if not engine.same_bytes(a, b):
                    raise RuntimeError(f"{sidecar.name}: block {b} does not hold block {a}'s "
                                       "bytes after load")
    return saved, loaded


async def one_round(
    sidecars: Sequence[Sidecar], engine: Engine, raw: RawClient, concurrency: int,
    *, rotate: int, verify: bool,
) -> dict[str, float]:
    """Each sidecar's save and load of a fresh round, and the raw calls on the same
    number of values, one after the other in an order rotated by ``rotate``."""
    workload = sidecars[0].workload
    times: dict[str, float] = {}
    sides: list[Sidecar | None] = [None, *sidecars]  # None: the raw calls
    for side in sides[rotate % len(sides):] + sides[: rotate % len(sides)]:
        if side is not None:
            times[f"{side.name} save"], times[f"{side.name} load"] = await sidecar_side(
                side, engine, concurrency, verify=verify)
            continue
        value_bytes = max(sidecar.stored_bytes for sidecar in sidecars)
        puts, gets = raw.calls(f"r{rotate}", workload.requests, workload.blocks, value_bytes)
        times["raw save"] = await run_raw(concurrency, puts)
        times["raw load"] = await run_raw(concurrency, gets)
        if verify and not raw.same_halves(workload.requests * workload.blocks * value_bytes):
            raise RuntimeError("raw batch_get_into did not return the bytes put")
    # Forced: the puts' and gets' leases would keep the objects for kv_lease_ttl_ms.
    await anyio.to_thread.run_sync(raw.client.remove_all, True)
    return times


async def measure(
    args: argparse.Namespace, sidecars: Sequence[Sidecar], engine: Engine, raw: RawClient
) -> list[dict[str, Any]]:
    """Per concurrency, every variant's GB/s and its ratios to the raw calls."""
    round_bytes = args.requests * args.blocks_per_request * engine.value_bytes
    for index in range(args.warmup):
        await one_round(sidecars, engine, raw, max(args.concurrency), rotate=index,
                        verify=index == 0)
    rows = []
    for concurrency in args.concurrency:
        samples = [await one_round(sidecars, engine, raw, concurrency, rotate=rep,
                                   verify=False)
                   for rep in range(args.repeat)]
        gbps = {name: median([round_bytes / s[name] / 1e9 for s in samples])
                for name in samples[0]}
        for sidecar in sidecars:
            paired = {
                op: statistics.median(s[f"raw {op}"] / s[f"{sidecar.name} {op}"]
                                      for s in samples)
                for op in ("save", "load")
            }
            rows.append({
                "variant": sidecar.name,
                "concurrency": concurrency,
                "round_bytes": round_bytes,
                "gbps": {op: gbps[f"{sidecar.name} {op}"] for op in ("save", "load")},
                "raw_gbps": {op: gbps[f"raw {op}"] for op in ("save", "load")},
                "save_ratio": gbps[f"{sidecar.name} save"] / gbps["raw save"],
                "load_ratio": gbps[f"{sidecar.name} load"] / gbps["raw load"],
                "paired_save_ratio": paired["save"],
                "paired_load_ratio": paired["load"],
                "samples_s": samples,
            })
    return rows


def on_master(base: Config, master: EmbeddedMaster, *, in_place: bool) -> Config:
    """``base`` pointed at the benchmark's master, moving values in place or not."""
    mooncake = msgspec.structs.replace(
        base.store.mooncake,
        master=master.endpoints.master_address,
        metadata_server=master.endpoints.metadata_server,
        in_place=in_place,
    )
    return msgspec.structs.replace(base, store=msgspec.structs.replace(base.store,
                                                                       mooncake=mooncake))


async def run(args: argparse.Namespace, base: Config) -> list[dict[str, Any]]:
    page_bytes = args.page_kib * 1024
    layout = make_layout(args.layers, page_bytes)
    total = args.requests * args.blocks_per_request
    engine = Engine(args.layers, page_bytes, args.engine_blocks, total)
    widest = engine.value_bytes + CHECKSUM_BYTES
    async with await open_embedded_master(base.store.mooncake) as master:
        raw = RawClient(base.store.mooncake, master, total * widest)
        try:
            with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp, \
                    contextlib.ExitStack() as running:
                async with contextlib.AsyncExitStack() as clients:
                    sidecars = []
                    variants = itertools.product(args.in_place, args.checksum)
                    for index, (moves, sums) in enumerate(variants):
                        checksum = sums == "on"
                        name = f"{'in place' if moves == 'on' else 'staging'}, checksum {sums}"
                        config = sidecar_config(on_master(base, master, in_place=moves == "on"),
                                                checksum, Path(tmp))
                        config = config.rename(config.with_name(f"in-place-{moves}-{config.name}"))
                        suffix = {"cprofile": "prof", "py-spy": "txt"}.get(args.profile, "")
                        profile_out = (
                            RESULTS_DIR / f"bench_mooncake_sidecar.in-place-{moves}.checksum-"
                                          f"{sums}.{suffix}"
                            if suffix else None
                        )
                        endpoint = running.enter_context(spawned_sidecar(
                            config, profile=args.profile, profile_out=profile_out)).endpoint
                        client = await clients.enter_async_context(await EngineClient.connect(
                            endpoint, layout=layout, kv_caches=engine.kv_caches))
                        sidecars.append(Sidecar(
                            name, client, engine.value_bytes + (CHECKSUM_BYTES if checksum else 0),
                            Workload(args.requests, args.blocks_per_request, args.engine_blocks,
                                     first_token=1 + index * 2**28)))
                    return await measure(args, sidecars, engine, raw)
        finally:
            raw.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-kib", type=int, default=64, help="bytes per block per layer")
    parser.add_argument("--engine-blocks", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--blocks-per-request", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--in-place", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--checksum", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--profile", choices=["cprofile", "py-spy"], default="")
    args = parser.parse_args(argv)

    base = load_config(args.config)
    if base.store.backend != "mooncake":
        parser.error(f"{args.config} does not use store.backend: mooncake")
    page_bytes = args.page_kib * 1024
    value_bytes = args.layers * page_bytes
    total = args.requests * args.blocks_per_request
    if 2 * total >= args.engine_blocks:
        parser.error("--engine-blocks must exceed twice the blocks of a round")
    if value_bytes + CHECKSUM_BYTES > base.staging.slot_bytes:
        parser.error("a block does not fit in a staging slot (staging.slot_bytes)")
    round_bytes = total * value_bytes
    if 2 * round_bytes > base.store.mooncake.global_segment_bytes // 2:
        parser.error("a round must fit in half a segment (store.mooncake.global_segment_bytes)")
    RESULTS_DIR.mkdir(exist_ok=True)

    print(
        f"{args.layers} layers x {args.page_kib} KiB pages = {value_bytes >> 10} KiB per "
        f"block; {args.requests} requests x {args.blocks_per_request} blocks = "
        f"{round_bytes / 2**20:.0f} MiB per round; median of {args.repeat}; config "
        f"{args.config.name} on an embedded master, {base.store.mooncake.protocol}"
        f"{'; profiled: ' + args.profile if args.profile else ''}"
    )
    results = anyio.run(run, args, base)

    print(
        f"{'values':>22} {'in flight':>9} {'raw save':>9} {'sidecar save':>13} {'ratio':>6} "
        f"{'raw load':>9} {'sidecar load':>13} {'ratio':>6}   (GB/s; ratio of medians)"
    )
    worst = math.inf
    for row in sorted(results, key=lambda row: (row["variant"], row["concurrency"])):
        g, r = row["gbps"], row["raw_gbps"]
        worst = min(worst, row["save_ratio"], row["load_ratio"])
        print(
            f"{row['variant']:>22} {row['concurrency']:>9} {r['save']:>9.2f} "
            f"{g['save']:>13.2f} {row['save_ratio']:>6.2f} {r['load']:>9.2f} "
            f"{g['load']:>13.2f} {row['load_ratio']:>6.2f}   (paired: save "
            f"{row['paired_save_ratio']:.2f}, load {row['paired_load_ratio']:.2f})"
        )
    verdict = "meets" if worst >= GOAL else "misses"
    print(f"worst ratio {worst:.2f} {verdict} the goal of {GOAL}")
    path = write_results(
        "bench_mooncake_sidecar",
        {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "goal": GOAL,
            "worst_ratio": worst,
            "results": results,
        },
    )
    print(f"results: {path.relative_to(ROOT)}")
    return 0 if worst >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
