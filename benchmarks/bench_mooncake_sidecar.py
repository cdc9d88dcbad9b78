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
  request, from a registered buffer), then ``batch_get_into`` of them back;
- raw pages: what vLLM's own Mooncake connector does, the same number of blocks put
  straight from the engine's KV tensors (registered with the raw client), each block's
  pages one value, with ``batch_put_from_multi_buffers``, then got into other blocks
  with ``batch_get_into_multi_buffers`` (one call per request each).

All the sidecars run at once, and each repetition takes turns in a rotated order, so
that every variant and the raw calls are measured in the same stretch of time.

Both land in the same cluster (the sidecar's segment and the raw client's, placed by the
master). Every object is removed (forced) after each repetition, so every put lands in
free space. The raw calls are the floor of what the sidecar must do; its extra work is
the existence checks, hashing, checksums and the socket, and through staging the
engine <-> staging copies. In place, a sidecar's loads read the values where they lie
in its own segment (``store.mooncake.read_here``), checked and copied in one pass by
its own threads, where the raw get is Mooncake's copy in one thread: a load's ratio can
pass 1.

    python benchmarks/bench_mooncake_sidecar.py [--geometry 8x64x8 24x48x16 16x64x32]
        [--requests 8] [--concurrency 1 4] [--repeat 7] [--in-place on off]
        [--checksum on off] [--config configs/mooncake.yaml] [--profile {cprofile,py-spy}]

A geometry is LAYERSxPAGE_KIBxBLOCKS_PER_REQUEST: by default a small request (4 MiB),
where the fixed cost of a request shows, and the two shapes the embedded store's goal
names (``bench_sidecar_throughput.py``). A round is ``--requests`` requests, fewer where
they would not fit in a quarter of the segment. Ratios are sidecar GB/s over raw GB/s
(goal: >= 0.9, against the raw calls), of the medians over the repetitions, with each
repetition's own ratio beside them (median and quartiles); the ratios against the raw
pages calls are printed after. What checksums cost is printed as GB/s with them on over
off. Results are also written to benchmarks/results/bench_mooncake_sidecar.json.
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
from bench_sidecar_throughput import (
    Engine,
    Geometry,
    Workload,
    make_layout,
    run_requests,
    sidecar_config,
)
from harness import (
    ROOT,
    checksum_cost,
    median,
    paired,
    paired_text,
    profile_path,
    request_medians,
    spawned_sidecar,
    stage_times,
    thread_cpu_s,
    write_results,
)

from pipeline.backends.stores.mooncake.master import EmbeddedMaster, open_embedded_master
from pipeline.backends.stores.mooncake.setup import replicate
from pipeline.core.config import Config, MooncakeStoreConfig, load_config
from pipeline.core.integrity import CHECKSUM_BYTES
from pipeline.core.outcomes import BlockStatus
from transport.client import EngineClient

GOAL = 0.9
DEFAULT_CONFIG = ROOT / "configs" / "mooncake.yaml"


class RawClient:
    """A raw Mooncake client on the same master, with one registered buffer of two halves,
    and the engine's KV tensors registered too (its pages' calls take blocks from
    ``pages``)."""

    def __init__(self, config: MooncakeStoreConfig, master: EmbeddedMaster, round_bytes: int,
                 engine: Engine, pages: Workload):
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
        self.engine = engine
        self.pages = pages
        for tensor in [self.buffer, *engine.kv_caches.values()]:
            rc = self.client.register_buffer(tensor.data_ptr(),
                                             tensor.numel() * tensor.element_size())
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

    def page_calls(
        self, prefix: str
    ) -> tuple[list[Callable[[], None]], list[Callable[[], None]], Callable[[], bool]]:
        """One batch_put_from_multi_buffers per request from the engine's pages of a
        fresh round's blocks, one batch_get_into_multi_buffers into other blocks, and
        whether those now hold the bytes put."""
        _, src, dst, _ = self.pages.next_round()
        tensors = list(self.engine.kv_caches.values())
        page = self.engine.page_bytes

        def pointers(blocks: list[int]) -> list[list[int]]:
            return [[t.data_ptr() + b * page for t in tensors] for b in blocks]

        puts, gets = [], []
        for r, (sources, targets) in enumerate(zip(src, dst, strict=True)):
            keys = [f"raw-pages-{prefix}-{r}-{i}" for i in range(len(sources))]
            sizes = [[page] * len(tensors)] * len(keys)
            src_ptrs, dst_ptrs = pointers(sources), pointers(targets)

            def put(keys: list[str] = keys, ptrs: list[list[int]] = src_ptrs,
                    sizes: list[list[int]] = sizes) -> None:
                codes = self.client.batch_put_from_multi_buffers(keys, ptrs, sizes,
                                                                 self.replicate)
                if codes != [0] * len(keys):
                    raise RuntimeError(f"raw batch_put_from_multi_buffers: {sorted(set(codes))}")

            def get(keys: list[str] = keys, ptrs: list[list[int]] = dst_ptrs,
                    sizes: list[list[int]] = sizes) -> None:
                codes = self.client.batch_get_into_multi_buffers(keys, ptrs, sizes)
                if codes != [sum(each) for each in sizes]:
                    raise RuntimeError(f"raw batch_get_into_multi_buffers: {sorted(set(codes))}")

            puts.append(put)
            gets.append(get)

        def loaded() -> bool:
            return all(self.engine.same_bytes(a, b)
                       for sources, targets in zip(src, dst, strict=True)
                       for a, b in zip(sources, targets, strict=True))

        return puts, gets, loaded

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

    values: str
    """How values move: "in place" or "staging"."""
    checksum: str
    """"on" or "off"."""
    pid: int
    client: EngineClient
    stored_bytes: int
    workload: Workload
    log: Callable[[], str]
    """Its log as written so far."""

    @property
    def name(self) -> str:
        return f"{self.values}, checksum {self.checksum}"


async def sidecar_side(
    sidecar: Sidecar, engine: Engine, concurrency: int, *, verify: bool
) -> tuple[float, float, dict[str, float]]:
    """Save a fresh round through ``sidecar``, then load it into other blocks: seconds
    for each, and the CPU seconds the sidecar spent on each (``thread_cpu_s``: on its
    event loop, and on its other threads, Mooncake's among them)."""
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
    before = thread_cpu_s(sidecar.pid)
    saved = await run_requests(concurrency, [lambda r=r: save(r) for r in calls])
    between = thread_cpu_s(sidecar.pid)
    loaded = await run_requests(concurrency, [lambda r=r: load(r) for r in calls])
    after = thread_cpu_s(sidecar.pid)
    cpu = {"loop_save": between[0] - before[0], "threads_save": between[1] - before[1],
           "loop_load": after[0] - between[0], "threads_load": after[1] - between[1]}
    if problems:
        raise RuntimeError(f"{sidecar.name}: " + "; ".join(problems[:4]))
    if verify:
        for r in calls:
            for a, b in zip(src[r], dst[r], strict=True):
                if not engine.same_bytes(a, b):
                    raise RuntimeError(f"{sidecar.name}: block {b} does not hold block {a}'s "
                                       "bytes after load")
    return saved, loaded, cpu


async def one_round(
    sidecars: Sequence[Sidecar], engine: Engine, raw: RawClient, concurrency: int,
    *, rotate: int, verify: bool,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Each sidecar's save and load of a fresh round, and the raw calls on the same
    number of values, one after the other in an order rotated by ``rotate``: seconds
    by name, and each sidecar's CPU seconds (``sidecar_side``)."""
    workload = sidecars[0].workload
    times: dict[str, float] = {}
    cpu: dict[str, dict[str, float]] = {}
    sides: list[Sidecar | None] = [None, *sidecars]  # None: the raw calls
    for side in sides[rotate % len(sides):] + sides[: rotate % len(sides)]:
        if side is not None:
            times[f"{side.name} save"], times[f"{side.name} load"], cpu[side.name] = (
                await sidecar_side(side, engine, concurrency, verify=verify))
            continue
        value_bytes = max(sidecar.stored_bytes for sidecar in sidecars)
        puts, gets = raw.calls(f"r{rotate}", workload.requests, workload.blocks, value_bytes)
        times["raw save"] = await run_raw(concurrency, puts)
        times["raw load"] = await run_raw(concurrency, gets)
        if verify and not raw.same_halves(workload.requests * workload.blocks * value_bytes):
            raise RuntimeError("raw batch_get_into did not return the bytes put")
        puts, gets, loaded = raw.page_calls(f"r{rotate}")
        times["raw pages save"] = await run_raw(concurrency, puts)
        times["raw pages load"] = await run_raw(concurrency, gets)
        if verify and not loaded():
            raise RuntimeError("raw batch_get_into_multi_buffers did not load the bytes put")
    # Forced: the puts' and gets' leases would keep the objects for kv_lease_ttl_ms.
    await anyio.to_thread.run_sync(raw.client.remove_all, True)
    return times, cpu


async def measure(
    args: argparse.Namespace, sidecars: Sequence[Sidecar], engine: Engine, raw: RawClient
) -> list[dict[str, Any]]:
    """Per concurrency, every variant's GB/s and its ratios to the raw calls."""
    workload = sidecars[0].workload
    round_bytes = workload.requests * workload.blocks * engine.value_bytes
    for index in range(args.warmup):
        await one_round(sidecars, engine, raw, max(args.concurrency), rotate=index,
                        verify=index == 0)
    rows = []
    for concurrency in args.concurrency:
        logged = {sidecar.name: len(sidecar.log()) for sidecar in sidecars}
        rounds = [await one_round(sidecars, engine, raw, concurrency, rotate=rep,
                                  verify=False)
                  for rep in range(args.repeat)]
        samples = [times for times, _ in rounds]
        requests = workload.requests * args.repeat
        gbps = {name: median([round_bytes / s[name] / 1e9 for s in samples])
                for name in samples[0]}
        for sidecar in sidecars:
            each_round = {op: paired(samples, f"raw {op}", f"{sidecar.name} {op}")
                          for op in ("save", "load")}
            rows.append({
                "variant": sidecar.name,
                "values": sidecar.values,
                "checksum": sidecar.checksum,
                "concurrency": concurrency,
                "round_bytes": round_bytes,
                "gbps": {op: gbps[f"{sidecar.name} {op}"] for op in ("save", "load")},
                "raw_gbps": {op: gbps[f"raw {op}"] for op in ("save", "load")},
                "raw_pages_gbps": {op: gbps[f"raw pages {op}"] for op in ("save", "load")},
                "save_ratio": gbps[f"{sidecar.name} save"] / gbps["raw save"],
                "load_ratio": gbps[f"{sidecar.name} load"] / gbps["raw load"],
                "pages_save_ratio": gbps[f"{sidecar.name} save"] / gbps["raw pages save"],
                "pages_load_ratio": gbps[f"{sidecar.name} load"] / gbps["raw pages load"],
                "paired_save_ratio": each_round["save"],
                "paired_load_ratio": each_round["load"],
                "cpu_ms_per_request": {
                    name: 1000 * sum(cpu[sidecar.name][name] for _, cpu in rounds) / requests
                    for name in ("loop_save", "threads_save", "loop_load", "threads_load")},
                "ms_per_request": {
                    op: 1000 * median([s[f"{sidecar.name} {op}"] for s in samples])
                    / workload.requests for op in ("save", "load")},
                "inside_ms": request_medians(sidecar.log()[logged[sidecar.name]:]),
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


def round_requests(args: argparse.Namespace, geometry: Geometry, base: Config) -> int:
    """Requests per round: ``--requests``, fewer where a round would not fit in a quarter
    of the segment (the sidecar's and the raw calls' rounds both land in the cluster)."""
    request_bytes = geometry.layers * geometry.page_kib * 1024 * geometry.blocks_per_request
    fits = base.store.mooncake.global_segment_bytes // 4 // request_bytes
    if fits < 1:
        raise SystemExit(f"{geometry}: a request must fit in a quarter of the segment "
                         "(store.mooncake.global_segment_bytes)")
    return min(args.requests, fits)


async def run(args: argparse.Namespace, geometry: Geometry, base: Config
              ) -> list[dict[str, Any]]:
    page_bytes = geometry.page_kib * 1024
    layout = make_layout(geometry.layers, page_bytes)
    requests = round_requests(args, geometry, base)
    total = requests * geometry.blocks_per_request
    engine_blocks = max(args.engine_blocks, 2 * total + 1)
    engine = Engine(geometry.layers, page_bytes, engine_blocks, total)
    widest = engine.value_bytes + CHECKSUM_BYTES
    print(f"{geometry}: {geometry.layers} layers x {geometry.page_kib} KiB pages = "
          f"{engine.value_bytes >> 10} KiB per block; {requests} requests x "
          f"{geometry.blocks_per_request} blocks = {total * engine.value_bytes / 2**20:.0f} "
          "MiB per round")
    async with await open_embedded_master(base.store.mooncake) as master:
        raw = RawClient(base.store.mooncake, master, total * widest, engine,
                        Workload(requests, geometry.blocks_per_request, engine_blocks))
        try:
            with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp, \
                    contextlib.ExitStack() as running:
                async with contextlib.AsyncExitStack() as clients:
                    sidecars = []
                    variants = itertools.product(args.in_place, args.checksum)
                    for index, (moves, sums) in enumerate(variants):
                        checksum = sums == "on"
                        config = sidecar_config(on_master(base, master, in_place=moves == "on"),
                                                checksum, Path(tmp))
                        config = config.rename(config.with_name(f"in-place-{moves}-{config.name}"))
                        profile_out = profile_path(
                            f"bench_mooncake_sidecar.{geometry}.in-place-{moves}."
                            f"checksum-{sums}", args.profile)
                        process = running.enter_context(spawned_sidecar(
                            config, profile=args.profile, profile_out=profile_out))
                        client = await clients.enter_async_context(await EngineClient.connect(
                            process.endpoint, layout=layout, kv_caches=engine.kv_caches))
                        sidecars.append(Sidecar(
                            "in place" if moves == "on" else "staging", sums, process.pid,
                            client,
                            engine.value_bytes + (CHECKSUM_BYTES if checksum else 0),
                            Workload(requests, geometry.blocks_per_request, engine_blocks,
                                     first_token=1 + index * 2**28), process.log))
                    rows = await measure(args, sidecars, engine, raw)
                    return [{"geometry": str(geometry), **row} for row in rows]
        finally:
            raw.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", type=Geometry.parse, nargs="+",
                        default=[Geometry(8, 64, 8), Geometry(24, 48, 16), Geometry(16, 64, 32)],
                        help="LAYERSxPAGE_KIBxBLOCKS_PER_REQUEST, one or more")
    parser.add_argument("--engine-blocks", type=int, default=256,
                        help="at least; more where twice a round's blocks need them")
    parser.add_argument("--requests", type=int, default=8, help="requests per round, at most")
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
    for geometry in args.geometry:
        if geometry.layers * geometry.page_kib * 1024 + CHECKSUM_BYTES > base.staging.slot_bytes:
            parser.error(f"{geometry}: a block does not fit in a staging slot "
                         "(staging.slot_bytes)")

    print(
        f"median of {args.repeat}; config {args.config.name} on an embedded master, "
        f"{base.store.mooncake.protocol}{'; profiled: ' + args.profile if args.profile else ''}"
    )
    results = [row for geometry in args.geometry for row in anyio.run(run, args, geometry, base)]

    print(
        f"{'geometry':>9} {'values':>22} {'in flight':>9} {'raw save':>9} {'sidecar save':>13} "
        f"{'ratio':>6} {'raw load':>9} {'sidecar load':>13} {'ratio':>6}   (GB/s; ratio of "
        "medians)"
    )
    worst = math.inf
    order = [str(geometry) for geometry in args.geometry]
    rows = sorted(results, key=lambda row: (order.index(row["geometry"]), row["variant"],
                                            row["concurrency"]))
    for row in rows:
        g, r = row["gbps"], row["raw_gbps"]
        worst = min(worst, row["save_ratio"], row["load_ratio"])
        print(
            f"{row['geometry']:>9} {row['variant']:>22} {row['concurrency']:>9} "
            f"{r['save']:>9.2f} {g['save']:>13.2f} {row['save_ratio']:>6.2f} {r['load']:>9.2f} "
            f"{g['load']:>13.2f} {row['load_ratio']:>6.2f}   (paired: save "
            f"{paired_text(row['paired_save_ratio'])}, load "
            f"{paired_text(row['paired_load_ratio'])})"
        )
    verdict = "meets" if worst >= GOAL else "misses"
    print(f"worst ratio {worst:.2f} {verdict} the goal of {GOAL}")
    print("against the raw pages calls, as vLLM's own Mooncake connector moves blocks "
          "(multi-buffer, straight from and into the engine's KV tensors)")
    print(f"{'geometry':>9} {'values':>22} {'in flight':>9} {'pages save':>11} {'ratio':>6} "
          f"{'pages load':>11} {'ratio':>6}   (GB/s)")
    for row in rows:
        p = row["raw_pages_gbps"]
        print(f"{row['geometry']:>9} {row['variant']:>22} {row['concurrency']:>9} "
              f"{p['save']:>11.2f} {row['pages_save_ratio']:>6.2f} {p['load']:>11.2f} "
              f"{row['pages_load_ratio']:>6.2f}")
    print("sidecar CPU ms per request (all rounds): its event loop, and its other threads "
          "(Mooncake's copies and calls, sockets, logs)")
    print(f"{'geometry':>9} {'values':>22} {'in flight':>9} {'save loop':>10} {'threads':>8} "
          f"{'load loop':>10} {'threads':>8}")
    for row in rows:
        ms = row["cpu_ms_per_request"]
        print(f"{row['geometry']:>9} {row['variant']:>22} {row['concurrency']:>9} "
              f"{ms['loop_save']:>10.2f} {ms['threads_save']:>8.2f} {ms['loop_load']:>10.2f} "
              f"{ms['threads_load']:>8.2f}")
    print("a request's share of a round, ms, and inside the sidecar (medians from its log, ms "
          "after receipt: each stage's end, then the reply)")
    for row in rows:
        for op in ("save", "load"):
            inside = row["inside_ms"].get(op, {})
            print(f"{row['geometry']:>9} {row['variant']:>22} {row['concurrency']:>9} {op}: "
                  f"{row['ms_per_request'][op]:.2f}; {stage_times(inside)}")
    integrity = checksum_cost(results, ("geometry", "values", "concurrency"), "save", "load")
    path = write_results(
        "bench_mooncake_sidecar",
        {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k != "geometry"},
            "geometries": [str(g) for g in args.geometry],
            "goal": GOAL,
            "worst_ratio": worst,
            "results": results,
            "integrity": integrity,
        },
    )
    print(f"results: {path.relative_to(ROOT)}")
    return 0 if worst >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
