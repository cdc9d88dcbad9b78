"""Save and load throughput through a real sidecar process against a bare torch copy.

An engine (this process) owns its KV tensors in shared memory and drives a sidecar
started as ``python -m pipeline.app.cli serve`` on the embedded store. Each repetition saves
a batch of requests whose blocks are new to the store (fresh token ids, so nothing is
deduplicated), then loads the same blocks back into other engine blocks. The baseline,
timed in the same run on the same block ids and bytes, is the copy the sidecar must do
at minimum: ``torch.index_select(layer, 0, ids, out=staging_columns)`` per layer for a
save, ``layer.index_copy_(0, ids, staging_columns)`` for a load, over the whole round at
once (the goal's baseline). The same copy done request by request, as the sidecar is
asked for it, is shown beside it: the gap between the two is what granularity alone
costs.

    python benchmarks/bench_sidecar_throughput.py [--geometry 24x48x16 16x64x32]
        [--engine-blocks 2048] [--requests 8] [--concurrency 1 4] [--checksum on off]
        [--repeat 5] [--config configs/default.yaml] [--profile {cprofile,py-spy}]

A geometry is layers x page KiB x blocks per request; each runs with checksums on and
off (one sidecar each). Ratios are sidecar GB/s over bare-copy GB/s (goal, with the
default config's checksums on: >= 0.8), of the medians over the rounds; beside them, the
median and quartiles of each round's own ratio, against the bare copy timed in that
round, and the bare copy's range over the rounds (how far the machine drifted). Where
both variants ran, what integrity costs is printed too: sidecar GB/s with checksums on
over off (1.0: free). Then the CPU each
request cost: the bare copy (this process, torch's threads included), the sidecar's
event loop and its other threads (copies, sockets, logs), and the engine's client (this
process, while the sidecar served it), summed over the rounds: at 4 in flight on a small
machine the cores are the limit, and these show whose work fills them. Last, at 1 in
flight, what the engine waits beyond the sidecar's receipt to reply, request by request
(the sockets both ways, the client's encoding and decoding), and the ratio a sidecar
would reach if its receipt to reply took no longer than the bare copy: on a small VM
that round trip, some 0.5 ms after a copy against 0.15 ms idle, keeps that ratio near
0.8 at 24 x 48 KiB x 16. Results are also written to
benchmarks/results/bench_sidecar_throughput.json.
"""

from __future__ import annotations

import os

# Idle OpenMP threads must not spin: on a small machine the sidecar's spinning copy
# threads steal the cores the engine's baseline copy runs on, and the engine's steal
# the sidecar's, so neither side would be measured fairly. Set before torch loads
# OpenMP; the sidecar process inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch
from harness import (
    DEFAULT_CONFIG,
    ROOT,
    checksum_cost,
    median,
    paired,
    paired_text,
    profile_path,
    reply_ms,
    request_medians,
    run_requests,
    spawned_sidecar,
    stage_times,
    thread_cpu_s,
    write_results,
)

from pipeline.core.config import Config, load_config
from pipeline.core.layout import KVCacheLayout
from pipeline.core.outcomes import BlockStatus
from pipeline.testing import SidecarProcess
from transport.client import EngineClient
from transport.tensors import shared_kv_caches

GOAL = 0.8
BLOCK_SIZE = 16


def make_layout(layers: int, page_bytes: int) -> dict[str, Any]:
    return {
        "model": "bench/throughput",
        "groups": [{
            "kind": "full_attention", "block_size": BLOCK_SIZE, "dtype": "bfloat16",
            "page_bytes": page_bytes, "layers": [f"layers.{i}" for i in range(layers)],
        }],
    }


class Engine:
    """KV tensors in shared memory and the bare-copy baseline over them."""

    def __init__(self, layers: int, page_bytes: int, num_blocks: int, staging_rows: int) -> None:
        layout = KVCacheLayout.from_dict(make_layout(layers, page_bytes))
        self.kv_caches = shared_kv_caches(layout, num_blocks)
        for tensor in self.kv_caches.values():
            tensor.view(torch.int16).random_()
        # The bare copy moves the bytes as 8-byte words: torch's index_copy_ on byte rows
        # is several times slower, and the baseline must be the fastest plain copy.
        self.word_bytes = 8 if page_bytes % 8 == 0 else 1
        word = torch.int64 if self.word_bytes == 8 else torch.uint8
        self.pages = [t.view(torch.uint8).view(word) for t in self.kv_caches.values()]
        self.page_bytes = page_bytes
        self.value_bytes = layers * page_bytes
        # One row per block, like a staging slot; touched now so no rep pays page faults.
        self.staging = torch.zeros(staging_rows, self.value_bytes, dtype=torch.uint8).view(word)

    def _columns(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        words = self.page_bytes // self.word_bytes
        return rows[:, layer * words : (layer + 1) * words]

    def bare_gather(self, ids: torch.Tensor, first_row: int = 0) -> None:
        rows = self.staging[first_row : first_row + len(ids)]
        for i, page in enumerate(self.pages):
            torch.index_select(page, 0, ids, out=self._columns(rows, i))

    def bare_scatter(self, ids: torch.Tensor, first_row: int = 0) -> None:
        rows = self.staging[first_row : first_row + len(ids)]
        for i, page in enumerate(self.pages):
            page.index_copy_(0, ids, self._columns(rows, i))

    def same_bytes(self, a: int, b: int) -> bool:
        """Whether engine blocks a and b hold the same bytes in every layer."""
        return all(torch.equal(page[a], page[b]) for page in self.pages)


def timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Workload:
    """Fresh token ids and block ids for each repetition's requests."""

    def __init__(self, requests: int, blocks_per_request: int, num_blocks: int,
                 first_token: int = 1) -> None:
        """``first_token``: where this workload's token ids start (workloads that must
        never share a key start far apart)."""
        self.requests = requests
        self.blocks = blocks_per_request
        self.num_blocks = num_blocks
        self._next_token = first_token
        self._rng = random.Random(0)
        self._round = 0

    def next_round(self) -> tuple[list[list[int]], list[list[int]], list[list[int]], str]:
        """Tokens, source block ids (saved), destination block ids (loaded into), id prefix."""
        per_request = self.blocks * BLOCK_SIZE
        tokens = []
        for _ in range(self.requests):
            tokens.append(list(range(self._next_token, self._next_token + per_request)))
            self._next_token += per_request
        total = self.requests * self.blocks
        ids = self._rng.sample(range(1, self.num_blocks), 2 * total)  # 0 is the null block
        src = [ids[r * self.blocks : (r + 1) * self.blocks] for r in range(self.requests)]
        dst = [ids[total + r * self.blocks : total + (r + 1) * self.blocks]
               for r in range(self.requests)]
        self._round += 1
        return tokens, src, dst, f"r{self._round}"


async def sidecar_cpu_during(
    pid: int, run: Callable[[], Any],
) -> tuple[float, float, float, float]:
    """``await run()``: its wall seconds, then the CPU seconds sidecar ``pid`` spent
    meanwhile on its event loop and on its other threads (as ``thread_cpu_s`` splits it),
    and this process, the engine asking."""
    loop_before, others_before = thread_cpu_s(pid)
    engine_before = time.process_time()
    wall = await run()
    engine = time.process_time() - engine_before
    loop_after, others_after = thread_cpu_s(pid)
    return wall, loop_after - loop_before, others_after - others_before, engine


def cpu_timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall and CPU seconds (this process, torch's threads included) of ``fn()``."""
    cpu = time.process_time()
    wall = timed(fn)
    return wall, time.process_time() - cpu


async def one_round(client: EngineClient, engine: Engine, workload: Workload,
                    concurrency: int, sidecar_pid: int, *,
                    verify: bool) -> dict[str, Any]:
    tokens, src, dst, prefix = workload.next_round()
    src_ids = torch.tensor([b for ids in src for b in ids], dtype=torch.int64)
    dst_ids = torch.tensor([b for ids in dst for b in ids], dtype=torch.int64)
    problems: list[str] = []
    waits: dict[str, dict[str, float]] = {"save": {}, "load": {}}
    """Each request's wait at the engine, from the client's call to its return, by id."""

    async def save(r: int) -> None:
        started = time.perf_counter()
        result = await client.save(f"{prefix}-{r}", tokens[r], [src[r]])
        waits["save"][f"{prefix}-{r}"] = time.perf_counter() - started
        if result.stored != len(src[r]):
            problems.append(f"save {r}: {result.stored} stored, {result.present} present, "
                            f"{result.skipped} skipped, {result.failed} failed")

    async def load(r: int) -> None:
        started = time.perf_counter()
        result = await client.load(f"{prefix}-{r}", tokens[r], [dst[r]], len(tokens[r]))
        waits["load"][f"{prefix}-{r}"] = time.perf_counter() - started
        loaded = sum(1 for b in result.blocks if b.status is BlockStatus.LOADED)
        if loaded != len(dst[r]):
            problems.append(f"load {r}: {loaded}/{len(dst[r])} loaded")

    calls = range(workload.requests)
    per_request = [  # (first staging row, source ids, destination ids)
        (r * workload.blocks, torch.tensor(src[r]), torch.tensor(dst[r])) for r in calls
    ]
    # Interleaved so drift in machine load hits the baselines and the sidecar alike.
    bare_save, bare_save_cpu = cpu_timed(lambda: engine.bare_gather(src_ids))
    bare_save_each = timed(lambda: [engine.bare_gather(s, row) for row, s, _ in per_request])
    side_save, loop_save_cpu, threads_save_cpu, engine_save_cpu = await sidecar_cpu_during(
        sidecar_pid, lambda: run_requests(concurrency, [lambda r=r: save(r) for r in calls]))
    bare_load, bare_load_cpu = cpu_timed(lambda: engine.bare_scatter(dst_ids))
    bare_load_each = timed(lambda: [engine.bare_scatter(d, row) for row, _, d in per_request])
    side_load, loop_load_cpu, threads_load_cpu, engine_load_cpu = await sidecar_cpu_during(
        sidecar_pid, lambda: run_requests(concurrency, [lambda r=r: load(r) for r in calls]))
    if problems:
        raise RuntimeError("; ".join(problems[:4]))
    if verify:
        for r in calls:
            for a, b in zip(src[r], dst[r], strict=True):
                if not engine.same_bytes(a, b):
                    raise RuntimeError(f"block {b} does not hold block {a}'s bytes after load")
    return {
        "bare_save": bare_save, "bare_save_each": bare_save_each, "sidecar_save": side_save,
        "bare_load": bare_load, "bare_load_each": bare_load_each, "sidecar_load": side_load,
        "waits": waits,
        "cpu": {"bare_save": bare_save_cpu, "loop_save": loop_save_cpu,
                "threads_save": threads_save_cpu, "engine_save": engine_save_cpu,
                "bare_load": bare_load_cpu, "loop_load": loop_load_cpu,
                "threads_load": threads_load_cpu, "engine_load": engine_load_cpu},
    }


async def measure(args: argparse.Namespace, sidecar: SidecarProcess, engine: Engine,
                  layout: dict[str, Any], store_bytes: int) -> list[dict[str, Any]]:
    workload = Workload(args.requests, args.blocks_per_request, args.engine_blocks)
    round_bytes = args.requests * args.blocks_per_request * engine.value_bytes
    # Fill the store's arena once so every measured round runs in steady state (pages
    # touched, LRU evicting), as a long-running sidecar does.
    warmup = math.ceil(store_bytes / round_bytes) + 1
    rows = []
    async with await EngineClient.connect(sidecar.endpoint, layout=layout,
                                          kv_caches=engine.kv_caches) as client:
        for index in range(warmup):
            await one_round(client, engine, workload, max(args.concurrency), sidecar.pid,
                            verify=index == 0)
        for concurrency in args.concurrency:
            logged = len(sidecar.log())
            samples = [await one_round(client, engine, workload, concurrency, sidecar.pid,
                                       verify=False)
                       for _ in range(args.repeat)]
            log = sidecar.log()[logged:]
            gbps = {name: median([round_bytes / s[name] / 1e9 for s in samples])
                    for name in samples[0] if name not in ("cpu", "waits")}
            # Summed over the rounds, not a median: one round's CPU is a few ms.
            requests = args.repeat * args.requests
            cpu_ms = {name: 1000 * sum(s["cpu"][name] for s in samples) / requests
                      for name in samples[0]["cpu"]}
            rows.append({
                "concurrency": concurrency,
                "round_bytes": round_bytes,
                "gbps": gbps,
                "save_ratio": gbps["sidecar_save"] / gbps["bare_save"],
                "load_ratio": gbps["sidecar_load"] / gbps["bare_load"],
                "paired_save_ratio": paired(samples, "bare_save", "sidecar_save"),
                "paired_load_ratio": paired(samples, "bare_load", "sidecar_load"),
                "bare_gbps_range": {
                    op: [round_bytes / max(s[f"bare_{op}"] for s in samples) / 1e9,
                         round_bytes / min(s[f"bare_{op}"] for s in samples) / 1e9]
                    for op in ("save", "load")},
                "cpu_ms_per_request": cpu_ms,
                "ms_per_request": {name: 1000 * median([s[name] for s in samples])
                                   / args.requests for name in gbps},
                "inside_ms": request_medians(log),
                "outside_ms": outside_ms(samples, reply_ms(log), args.requests),
                "samples_s": samples,
            })
    return rows


def outside_ms(samples: Sequence[dict[str, Any]], replied: dict[tuple[str, str], float],
               requests: int) -> dict[str, dict[str, float]]:
    """Per request, in ms, what the engine waited beyond the sidecar's receipt to reply
    (``round_trip``: the sockets both ways, the client's encoding and decoding), matched
    by request id, its median and mean; and the engine's time between its calls
    (``between``: a round's wall time less its calls' waits, over its requests; at 1 in
    flight, all of a round but its calls)."""
    figures = {}
    for op in ("save", "load"):
        round_trips = [1000 * wait - replied[op, request_id] for s in samples
                       for request_id, wait in s["waits"][op].items()
                       if (op, request_id) in replied] or [math.nan]  # no request lines
        figures[op] = {
            "wait": 1000 * median([w for s in samples for w in s["waits"][op].values()]),
            "round_trip": median(round_trips),
            "round_trip_mean": sum(round_trips) / len(round_trips),
            "between": 1000 * median([(s[f"sidecar_{op}"] - sum(s["waits"][op].values()))
                                      / requests for s in samples]),
        }
    return figures


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One benchmarked shape: layers x page KiB x blocks per request."""

    layers: int
    page_kib: int
    blocks_per_request: int

    @classmethod
    def parse(cls, text: str) -> Geometry:
        try:
            layers, page_kib, blocks = (int(part) for part in text.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected LAYERSxPAGE_KIBxBLOCKS, e.g. 24x48x16"
            ) from None
        return cls(layers, page_kib, blocks)

    def __str__(self) -> str:
        return f"{self.layers}x{self.page_kib}x{self.blocks_per_request}"


def sidecar_config(base: Config, checksum: bool, directory: Path) -> Path:
    """``base`` with ``store.checksum`` set, as a file for the sidecar."""
    config = msgspec.structs.replace(
        base, store=msgspec.structs.replace(base.store, checksum=checksum)
    )
    path = directory / f"sidecar-checksum-{'on' if checksum else 'off'}.yaml"
    path.write_bytes(msgspec.yaml.encode(config))
    return path


def measure_geometry(args: argparse.Namespace, geometry: Geometry, base: Config,
                     directory: Path) -> list[dict[str, Any]]:
    """Every checksum variant and concurrency of one geometry, each row with its ratios."""
    store_bytes = base.store.embedded.capacity_bytes
    page_bytes = geometry.page_kib * 1024
    total = args.requests * geometry.blocks_per_request
    if 2 * total >= args.engine_blocks:
        raise SystemExit(f"{geometry}: --engine-blocks must exceed twice the blocks of a round")
    if total * geometry.layers * page_bytes > store_bytes // 2:
        raise SystemExit(f"{geometry}: a round must fit in half the store "
                         "(store.embedded.capacity_bytes)")
    layout = make_layout(geometry.layers, page_bytes)
    engine = Engine(geometry.layers, page_bytes, args.engine_blocks, total)
    shape = argparse.Namespace(**{**vars(args), "layers": geometry.layers,
                                  "page_kib": geometry.page_kib,
                                  "blocks_per_request": geometry.blocks_per_request})
    print(f"{geometry}: {geometry.layers} layers x {geometry.page_kib} KiB pages = "
          f"{engine.value_bytes >> 10} KiB per block; {args.requests} requests x "
          f"{geometry.blocks_per_request} blocks = {total * engine.value_bytes / 2**20:.0f} MiB "
          f"per round")
    rows = []
    sidecar_env = dict(item.split("=", 1) for item in args.sidecar_env)
    for variant in args.checksum:
        profile_out = profile_path(
            f"bench_sidecar_throughput.{geometry}.checksum-{variant}", args.profile)
        config = sidecar_config(base, variant == "on", directory)
        with spawned_sidecar(config, profile=args.profile, profile_out=profile_out,
                             env=sidecar_env) as sidecar:
            for row in anyio.run(measure, shape, sidecar, engine, layout, store_bytes):
                rows.append({"geometry": str(geometry), "checksum": variant, **row})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", type=Geometry.parse, nargs="+",
                        default=[Geometry(24, 48, 16), Geometry(16, 64, 32)],
                        help="LAYERSxPAGE_KIBxBLOCKS_PER_REQUEST, one or more")
    parser.add_argument("--engine-blocks", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--checksum", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--profile", choices=["cprofile", "py-spy"], default="")
    parser.add_argument("--sidecar-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment of the sidecar process only (e.g. OMP_NUM_THREADS=1)")
    args = parser.parse_args(argv)

    base = load_config(args.config)
    print(f"median of {args.repeat} rounds; config {args.config.name}"
          f"{'; profiled: ' + args.profile if args.profile else ''}")
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        rows = [row for geometry in args.geometry
                for row in measure_geometry(args, geometry, base, Path(tmp))]

    print(f"{'geometry':>9} {'checksum':>8} {'in flight':>9} {'bare save':>10} "
          f"{'sidecar save':>13} {'ratio':>6} {'bare load':>10} {'sidecar load':>13} "
          f"{'ratio':>6}   (GB/s)   per-request bare copy: {'save':>5} {'ratio':>6} "
          f"{'load':>5} {'ratio':>6}")
    worst = math.inf
    for row in rows:
        g = row["gbps"]
        if row["checksum"] == "on":  # the goal is the default config's: checksums on
            worst = min(worst, row["save_ratio"], row["load_ratio"])
        print(f"{row['geometry']:>9} {row['checksum']:>8} {row['concurrency']:>9} "
              f"{g['bare_save']:>10.2f} {g['sidecar_save']:>13.2f} {row['save_ratio']:>6.2f} "
              f"{g['bare_load']:>10.2f} {g['sidecar_load']:>13.2f} {row['load_ratio']:>6.2f}   "
              f"{'':>31}{g['bare_save_each']:>5.2f} "
              f"{g['sidecar_save'] / g['bare_save_each']:>6.2f} {g['bare_load_each']:>5.2f} "
              f"{g['sidecar_load'] / g['bare_load_each']:>6.2f}")
    verdict = "meets" if worst >= GOAL else "misses"
    print(f"worst ratio with checksums on {worst:.2f} {verdict} the goal of {GOAL}")
    print("each round's own ratio, against the bare copy timed beside it in that round: "
          "median [quartiles]; the bare copy's GB/s over the rounds, lowest-highest")
    for row in rows:
        low_high = {op: "-".join(f"{gbps:.2f}" for gbps in row["bare_gbps_range"][op])
                    for op in ("save", "load")}
        print(f"{row['geometry']:>9} {row['checksum']:>8} {row['concurrency']:>9} save "
              f"{paired_text(row['paired_save_ratio'])} (bare {low_high['save']}), load "
              f"{paired_text(row['paired_load_ratio'])} (bare {low_high['load']})")
    print("CPU ms per request (all rounds): the bare copy's (torch's threads included); the "
          "sidecar's event loop and its other threads (copies, sockets, logs); the engine's "
          "(this process: its client, while the sidecar served it)")
    print(f"{'geometry':>9} {'checksum':>8} {'in flight':>9} {'bare save':>10} {'loop':>6} "
          f"{'threads':>8} {'engine':>7} {'bare load':>10} {'loop':>6} {'threads':>8} "
          f"{'engine':>7}")
    for row in rows:
        ms = row["cpu_ms_per_request"]
        print(f"{row['geometry']:>9} {row['checksum']:>8} {row['concurrency']:>9} "
              f"{ms['bare_save']:>10.2f} {ms['loop_save']:>6.2f} {ms['threads_save']:>8.2f} "
              f"{ms['engine_save']:>7.2f} {ms['bare_load']:>10.2f} {ms['loop_load']:>6.2f} "
              f"{ms['threads_load']:>8.2f} {ms['engine_load']:>7.2f}")
    print("a request's share of a round, ms: the bare copy request by request, the sidecar, "
          "the engine's wait (median, call to return); inside the sidecar (medians from its "
          "log, ms after receipt: each stage's end, then the reply)")
    for row in rows:
        each = row["ms_per_request"]
        for op in ("save", "load"):
            print(f"{row['geometry']:>9} {row['checksum']:>8} {row['concurrency']:>9} {op}: "
                  f"{each[f'bare_{op}_each']:.2f}, {each[f'sidecar_{op}']:.2f}, "
                  f"{row['outside_ms'][op]['wait']:.2f}; "
                  f"{stage_times(row['inside_ms'].get(op, {}))}")
    print("1 in flight, outside the sidecar, ms a request: the round trip (the engine's wait "
          "less the sidecar's receipt to reply, request by request: median, mean) and the "
          "engine's time between its calls; and the ratio a sidecar would reach, all else "
          "the same (the mean round trip), whose receipt to reply took just the bare "
          "copy's share of the round")
    for row in rows:
        if row["concurrency"] != 1:
            continue
        parts = []
        for op in ("save", "load"):
            outside = row["outside_ms"][op]
            bare = row["ms_per_request"][f"bare_{op}"]
            parts.append(f"{op} {outside['round_trip']:.2f}, {outside['round_trip_mean']:.2f} "
                         f"+ {outside['between']:.2f}, as quick as the bare copy "
                         f"{bare / (bare + outside['round_trip_mean'] + outside['between']):.2f}")
        print(f"{row['geometry']:>9} {row['checksum']:>8} {row['concurrency']:>9} "
              + "; ".join(parts))
    integrity = checksum_cost(rows, ("geometry", "concurrency"), "sidecar_save", "sidecar_load")
    path = write_results("bench_sidecar_throughput", {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k != "geometry"},
        "geometries": [str(g) for g in args.geometry],
        "goal": GOAL, "worst_ratio": worst, "rows": rows,
        "integrity": integrity,
    })
    print(f"results: {path.relative_to(ROOT)}")
    return 0 if worst >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
