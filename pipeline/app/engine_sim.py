"""A simulated engine: a real user of the public client API, for the demo and load tests.

It owns KV tensors in shared memory laid out like the engine's, runs requests with
shared prefixes (lookup -> load -> "compute" the rest -> save) and checks every loaded
block byte for byte. A block's bytes are a pure function of its layer and its block
hash, exactly as real KV is a function of the prefix: any engine can tell what another
engine must have saved for the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch

from pipeline.core.errors import KVSidecarError
from pipeline.core.hashing import block_hashes, group_block_hashes
from pipeline.core.layout import GroupKind, KVCacheLayout
from pipeline.core.outcomes import BlockStatus
from transport.client import EngineClient
from transport.tensors import shared_kv_caches

__all__ = ["SimEngine", "SimReport", "load_layout", "run_engine_sim", "run_workload"]

LAYOUTS_DIR = Path(__file__).resolve().parents[2] / "configs" / "layouts"
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio step, as a signed int64


def load_layout(name_or_path: str, *, block_size: int = 0) -> KVCacheLayout:
    """A preset by name (configs/layouts/NAME.yaml) or a YAML path, optionally scaled so
    that the largest block holds ``block_size`` tokens (pages shrink in proportion)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = LAYOUTS_DIR / f"{name_or_path}.yaml"
        if not LAYOUTS_DIR.is_dir():
            raise KVSidecarError(f"layout presets are read from {LAYOUTS_DIR}, which is not "
                                 "there: run from a source checkout, or pass a layout file")
        if not path.exists():
            raise KVSidecarError(f"no layout preset {name_or_path!r}; the presets: " + ", ".join(
                sorted(p.stem for p in LAYOUTS_DIR.glob("*.yaml"))))
    data: dict[str, Any] = msgspec.yaml.decode(path.read_bytes())
    if block_size:
        largest = max(group["block_size"] for group in data["groups"])
        for group in data["groups"]:
            if group["kind"] == "circular_buffer":
                continue  # a ring's capacity is not a token block
            scaled = max(1, group["block_size"] * block_size // largest)
            if group.get("page_bytes"):
                group["page_bytes"] = max(64, group["page_bytes"] * scaled // group["block_size"])
            if group.get("sliding_window"):
                group["sliding_window"] = max(
                    1, group["sliding_window"] * scaled // group["block_size"]
                )
            group["block_size"] = scaled
        data.pop("block_size", None)
        data.pop("prefix_match_unit", None)
    return KVCacheLayout.from_dict(data)


def block_content(layer: str, block_hash: bytes, numel: int) -> torch.Tensor:
    """The bytes (as int64 words) an engine computes for one layer's block."""
    seed = int.from_bytes(block_hash[:8], "little", signed=True) ^ zlib.crc32(layer.encode())
    return torch.arange(numel, dtype=torch.int64).mul_(_MIX).add_(seed)


@dataclasses.dataclass
class SimReport:
    requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    loaded_tokens: int = 0
    blocks_stored: int = 0
    blocks_present: int = 0
    blocks_skipped: int = 0
    blocks_failed: int = 0
    blocks_loaded: int = 0
    blocks_verified: int = 0
    blocks_mismatched: int = 0
    ring_blocks_ignored: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    errors: int = 0

    def merge(self, other: SimReport) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class SimEngine:
    """KV tensors, a block allocator and the simulated compute of one engine."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.kv_caches = shared_kv_caches(layout, num_blocks, torch.int64)
        # Per kv-cache group; block 0 is null.
        self._free = [list(range(num_blocks - 1, 0, -1)) for _ in layout.groups]

    def value_bytes(self, kv_group_id: int) -> int:
        group = self.layout.groups[kv_group_id]
        return sum(self.kv_caches[layer][0].numel() * 8 for layer in group.layers)

    def allocate(self, kv_group_id: int, count: int) -> list[int]:
        free = self._free[kv_group_id]
        if len(free) < count:
            raise RuntimeError(f"group {kv_group_id}: out of blocks (raise --num-blocks)")
        return [free.pop() for _ in range(count)]

    def free(self, block_ids: list[list[int]]) -> None:
        for kv_group_id, ids in enumerate(block_ids):
            self._free[kv_group_id].extend(b for b in ids if b)

    def compute(self, kv_group_id: int, block_id: int, block_hash: bytes | None) -> None:
        """Write what the model would: content of the prefix, or scratch for the ring."""
        for layer in self.layout.groups[kv_group_id].layers:
            page = self.kv_caches[layer][block_id]
            if block_hash is None:
                page.random_()
            else:
                page.copy_(block_content(layer, block_hash, page.numel()))

    def matches(self, kv_group_id: int, block_id: int, block_hash: bytes) -> bool:
        return all(
            torch.equal(
                self.kv_caches[layer][block_id],
                block_content(layer, block_hash, self.kv_caches[layer][block_id].numel()),
            )
            for layer in self.layout.groups[kv_group_id].layers
        )


def make_workload(seed: int, prefixes: int, requests: int, block: int) -> list[list[int]]:
    """Requests that share a few long prefixes (like system prompts) plus unique tails.

    Every engine draws from the same pool, and every engine's first request opens with
    the pool's first prefix, so two engines of any seed share at least one prefix."""
    shared = random.Random(1234)  # every engine draws the same prefixes
    pool = [
        [shared.randrange(1, 50_000) for _ in range(block * shared.randint(2, 6))]
        for _ in range(prefixes)
    ]
    rng = random.Random(seed)
    return [
        (pool[0] if index == 0 else rng.choice(pool))
        + [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 3 * block))]
        for index in range(requests)
    ]


async def run_request(
    client: EngineClient, engine: SimEngine, request_id: str, tokens: list[int], report: SimReport
) -> None:
    layout = engine.layout
    hbs = layout.hash_block_size
    fine = block_hashes(tokens, hbs, seed=None)
    coarse = {
        gid: group_block_hashes(fine, hbs, layout.groups[gid].block_size)
        for gid in layout.prefix_cacheable_group_ids
    }
    block_ids: list[list[int]] = []
    for gid, group in enumerate(layout.groups):
        if group.kind is GroupKind.CIRCULAR_BUFFER:
            block_ids.append(engine.allocate(gid, 1))  # one ring block per request
        else:
            block_ids.append(engine.allocate(gid, -(-len(tokens) // group.block_size)))
    try:
        report.requests += 1
        report.lookup_tokens += len(tokens)
        hit = await client.lookup(tokens)
        report.hit_tokens += hit
        loaded: set[tuple[int, int]] = set()
        if hit:
            started = time.perf_counter()
            result = await client.load(request_id, tokens, block_ids, hit)
            report.load_seconds += time.perf_counter() - started
            report.loaded_tokens += result.loaded_tokens
            for block in result.blocks:
                if block.status is not BlockStatus.LOADED:
                    continue
                report.blocks_loaded += 1
                report.bytes_loaded += engine.value_bytes(block.group_id)
                expected = coarse[block.group_id][block.block_index]
                if engine.matches(block.group_id, block.block_id, expected):
                    report.blocks_verified += 1
                    loaded.add((block.group_id, block.block_index))
                else:
                    report.blocks_mismatched += 1
        for gid, ids in enumerate(block_ids):
            hashes = coarse.get(gid)
            for index, block_id in enumerate(ids):
                if (gid, index) in loaded:
                    continue
                if hashes is None:
                    engine.compute(gid, block_id, None)
                elif index < len(hashes):
                    engine.compute(gid, block_id, hashes[index])
        report.ring_blocks_ignored += sum(
            1
            for gid, ids in enumerate(block_ids)
            if layout.groups[gid].kind is GroupKind.CIRCULAR_BUFFER
            for b in ids
            if b
        )
        started = time.perf_counter()
        saved = await client.save(request_id, tokens, block_ids)
        report.save_seconds += time.perf_counter() - started
        report.blocks_stored += saved.stored
        report.blocks_present += saved.present
        report.blocks_skipped += saved.skipped
        report.blocks_failed += saved.failed
        report.bytes_saved += sum(
            engine.value_bytes(b.group_id) for b in saved.blocks if b.status is BlockStatus.STORED
        )
        ring_ids = {
            gid for gid, g in enumerate(layout.groups) if g.kind is GroupKind.CIRCULAR_BUFFER
        }
        if any(block.group_id in ring_ids for block in saved.blocks):
            report.errors += 1  # the ring must never reach the store
    finally:
        engine.free(block_ids)


async def run_workload(
    endpoint: str,
    layout: KVCacheLayout,
    *,
    engine_id: str | None,
    requests: int,
    prefixes: int,
    seed: int,
    concurrency: int,
    on_request: Callable[[int, SimReport], None] = lambda index, report: None,
) -> SimReport:
    largest = max(g.block_size for g in layout.store_groups)
    num_blocks = 2 + concurrency * (6 + 3 + 2) * max(
        1, largest // min(g.block_size for g in layout.store_groups)
    )
    engine = SimEngine(layout, num_blocks)
    report = SimReport()
    workload = make_workload(seed, prefixes, requests, largest)
    limiter = anyio.Semaphore(concurrency)
    async with await EngineClient.connect(
        endpoint, layout=layout, kv_caches=engine.kv_caches, engine_id=engine_id
    ) as client:

        async def one(index: int, tokens: list[int]) -> None:
            async with limiter:
                try:
                    await run_request(client, engine, f"{engine_id}-{seed}-{index}", tokens, report)
                except Exception as exc:
                    report.errors += 1
                    print(f"request {index} failed: {exc!r}", file=sys.stderr)
                on_request(index, report)

        async with anyio.create_task_group() as tg:
            for index, tokens in enumerate(workload):
                tg.start_soon(one, index, tokens)
    return report


def run_engine_sim(args: argparse.Namespace) -> int:
    layout = load_layout(args.layout, block_size=args.block_scale)

    done = 0

    def progress(index: int, report: SimReport) -> None:
        nonlocal done
        done += 1
        if args.json:
            print(json.dumps({"done": done, "request": index}), flush=True)

    report = anyio.run(
        lambda: run_workload(
            args.endpoint,
            layout,
            engine_id=args.engine_id,
            requests=args.requests,
            prefixes=args.prefixes,
            seed=args.seed,
            concurrency=args.concurrency,
            on_request=progress,
        )
    )
    if args.json:
        print(json.dumps({"report": dataclasses.asdict(report)}), flush=True)
    else:
        for key, value in dataclasses.asdict(report).items():
            print(f"{key:>20}: {value}")
    return 0 if report.blocks_mismatched == 0 and report.errors == 0 else 1
