"""Save (device to host) and load (host to device) of GPU KV blocks through a real
sidecar process, against a bare pinned copy of the same blocks in this process.

The engine (this process) keeps its KV tensors on cuda:0 and shares them by CUDA IPC
handle with a sidecar started with ``stages.transfer.device: cuda`` on the embedded
store. Each round saves requests of blocks new to the store, then loads them back into
other blocks, with some requests in flight. The baseline, timed in the same run on the
same blocks, is the least such a copy takes: per request, the blocks gathered into one
device matrix (``index_select`` per layer) and one ``copy_`` into pinned host memory;
the reverse for a load; all of a round queued, then one synchronize.

    python benchmarks/bench_cuda_copy.py [--layers 24] [--page-kib 64] [--blocks 32]
        [--requests 16] [--concurrency 4] [--repeat 5] [--checksum on off]
        [--threads N] [--profile {cprofile,py-spy}]

Ratios are sidecar GB/s over bare GB/s (goal: >= 0.9); each request's share of a round's
time is printed beside the sidecar's own medians, from its log (receipt to when each
stage finished its part, and to the reply): at one in flight, what the request spent
outside the sidecar is the difference. Loaded blocks are compared with
the saved ones byte for byte. Results go to benchmarks/results/bench_cuda_copy.json.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch
from harness import (
    DEFAULT_CONFIG,
    median,
    profile_path,
    request_medians,
    run_requests,
    spawned_sidecar,
    stage_times,
    write_results,
)

from pipeline.core.config import load_config
from transport.client import EngineClient

GOAL = 0.9
BLOCK_SIZE = 16


class Engine:
    """KV tensors on cuda:0, blocks-first, and the bare copies of their blocks."""

    def __init__(self, layers: int, page_bytes: int, engine_blocks: int, batch: int) -> None:
        self.page_bytes = page_bytes
        self.layout = {"model": "bench-cuda", "groups": [{
            "kind": "full_attention", "block_size": BLOCK_SIZE, "page_bytes": page_bytes,
            "layers": [f"layer.{i}" for i in range(layers)],
        }]}
        self.caches = {
            f"layer.{i}": torch.randint(-(2 ** 15), 2 ** 15, (engine_blocks, page_bytes // 2),
                                        dtype=torch.int16, device="cuda")
            for i in range(layers)
        }
        self.value_bytes = layers * page_bytes
        self.rows = torch.empty((batch, self.value_bytes), dtype=torch.uint8, device="cuda")
        self.host = torch.empty((batch, self.value_bytes), dtype=torch.uint8, pin_memory=True)

    def bare_save(self, ids: torch.Tensor) -> None:
        rows = self.rows[: ids.numel()]
        for index, tensor in enumerate(self.caches.values()):
            start = index * self.page_bytes
            rows[:, start : start + self.page_bytes].copy_(
                tensor.index_select(0, ids).view(torch.uint8))
        self.host[: ids.numel()].copy_(rows, non_blocking=True)

    def bare_load(self, ids: torch.Tensor) -> None:
        rows = self.rows[: ids.numel()]
        rows.copy_(self.host[: ids.numel()], non_blocking=True)
        for index, tensor in enumerate(self.caches.values()):
            start = index * self.page_bytes
            tensor.index_copy_(0, ids, rows[:, start : start + self.page_bytes].view(torch.int16))

    def same(self, a: int, b: int) -> bool:
        return all(torch.equal(tensor[a], tensor[b]) for tensor in self.caches.values())


def bare(requests: Sequence[torch.Tensor], copy: Callable[[torch.Tensor], None]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for ids in requests:
        copy(ids)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def draw(rng: random.Random, blocks: range, requests: int, count: int) -> list[list[int]]:
    """``count`` blocks for each request, no block in two requests: two loads into one
    block would leave only the later's bytes there."""
    picked = rng.sample(blocks, requests * count)
    return [picked[i : i + count] for i in range(0, len(picked), count)]


async def one_round(client: EngineClient, engine: Engine, args: argparse.Namespace,
                    rng: random.Random, counter: Iterator[int]) -> dict[str, float]:
    """Save requests of new blocks, then load them into other blocks: seconds of each,
    beside the bare copies of the same blocks."""
    half = args.engine_blocks // 2
    src = draw(rng, range(1, half), args.requests, args.blocks)
    dst = draw(rng, range(half, args.engine_blocks), args.requests, args.blocks)
    tokens = [[next(counter) for _ in range(args.blocks * BLOCK_SIZE)]
              for _ in range(args.requests)]
    failures: list[str] = []

    async def save(r: int) -> None:
        result = await client.save(f"s{tokens[r][0]}", tokens[r], [src[r]])
        if result.stored != args.blocks:
            failures.append(f"save {r}: {result.stored} stored")

    async def load(r: int) -> None:
        result = await client.load(f"l{tokens[r][0]}", tokens[r], [dst[r]], len(tokens[r]))
        if result.loaded_tokens != len(tokens[r]):
            failures.append(f"load {r}: {result.loaded_tokens} tokens")

    calls = range(args.requests)
    bare_save = bare([torch.tensor(s, device="cuda") for s in src], engine.bare_save)
    side_save = await run_requests(args.concurrency, [lambda r=r: save(r) for r in calls])
    bare_load = bare([torch.tensor(d, device="cuda") for d in dst], engine.bare_load)
    side_load = await run_requests(args.concurrency, [lambda r=r: load(r) for r in calls])
    if failures:
        raise RuntimeError("; ".join(failures[:4]))
    for r, (s, d) in enumerate(zip(src, dst, strict=True)):
        for a, b in zip(s, d, strict=True):
            if not engine.same(a, b):
                raise RuntimeError(f"request {r}: block {b} loaded differs from block {a} saved")
    return {"bare_save": bare_save, "sidecar_save": side_save,
            "bare_load": bare_load, "sidecar_load": side_load}


async def measure(args: argparse.Namespace, endpoint: str, engine: Engine) -> dict[str, Any]:
    rng = random.Random(0)
    counter = itertools.count(1)
    round_bytes = args.requests * args.blocks * engine.value_bytes
    async with await EngineClient.connect(endpoint, layout=engine.layout,
                                          kv_caches=engine.caches) as client:
        # The first round warms up (streams, pinned pages, the allocator) and is not counted.
        rounds = [await one_round(client, engine, args, rng, counter)
                  for _ in range(args.repeat + 1)][1:]

    def gbps(key: str) -> float:
        return round_bytes / median([r[key] for r in rounds]) / 1e9

    result: dict[str, Any] = {name: round(gbps(name), 2) for name in rounds[0]}
    result["ms_per_request"] = {name: round(median([r[name] for r in rounds])
                                            / args.requests * 1e3, 3) for name in rounds[0]}
    result["save_ratio"] = round(median([r["bare_save"] / r["sidecar_save"] for r in rounds]), 3)
    result["load_ratio"] = round(median([r["bare_load"] / r["sidecar_load"] for r in rounds]), 3)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=32, help="blocks per request")
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--engine-blocks", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--checksum", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--threads", type=int, default=0,
                        help="stages.transfer.threads (the checksums' threads); 0: the config's")
    parser.add_argument("--profile", choices=["cprofile", "py-spy"], default="")
    args = parser.parse_args(argv)
    if args.requests * args.blocks >= args.engine_blocks // 2:
        parser.error("a round's blocks (requests x blocks) must fit in half the engine blocks")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    engine = Engine(args.layers, args.page_kib << 10, args.engine_blocks,
                    args.blocks)
    round_bytes = args.requests * args.blocks * engine.value_bytes
    base = load_config(DEFAULT_CONFIG)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for checksum in args.checksum:
            config = msgspec.to_builtins(base)
            config["stages"]["transfer"]["device"] = "cuda"
            config["store"]["checksum"] = checksum == "on"
            if args.threads:
                config["stages"]["transfer"]["threads"] = args.threads
            config["store"]["embedded"]["capacity_bytes"] = 2 * (args.repeat + 1) * round_bytes
            config["staging"]["slot_bytes"] = max(config["staging"]["slot_bytes"],
                                                  args.blocks * (engine.value_bytes + 8))
            path = Path(tmp) / f"cuda-{checksum}.yaml"
            path.write_bytes(msgspec.yaml.encode(config))
            profile_out = profile_path(f"bench_cuda_copy.checksum-{checksum}", args.profile)
            with spawned_sidecar(path, profile=args.profile, profile_out=profile_out) as sidecar:
                figures = anyio.run(measure, args, sidecar.endpoint, engine)
                figures["inside_ms"] = request_medians(sidecar.final_log(timeout_s=60))
            results[f"checksum_{checksum}"] = figures
            print(f"checksum {checksum}: save {figures['sidecar_save']} GB/s "
                  f"(bare {figures['bare_save']}) ratio {figures['save_ratio']}; "
                  f"load {figures['sidecar_load']} GB/s (bare {figures['bare_load']}) "
                  f"ratio {figures['load_ratio']}  [goal >= {GOAL}]", flush=True)
            for kind in ("save", "load"):
                each = figures["ms_per_request"]
                inside = figures["inside_ms"].get(kind, {})
                print(f"  a {kind}, ms: bare {each[f'bare_{kind}']}, sidecar "
                      f"{each[f'sidecar_{kind}']}, inside it (receipt to each stage's end) "
                      + stage_times(inside), flush=True)
    write_results("bench_cuda_copy", {
        "device": torch.cuda.get_device_name(0), "goal": GOAL, "args": vars(args),
        "results": results,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
