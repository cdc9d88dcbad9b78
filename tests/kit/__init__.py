"""The test kit: small layouts, engines with random KV bytes, and a stallable relay."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

from pipeline.core.layout import KVCacheLayout
from pipeline.core.runs import Run
from transport.client import EngineClient
from transport.tensors import shared_kv_caches

__all__ = [
    "DIGEST_CASES", "KVEngine", "StallProxy", "engine_process", "hybrid_layout", "mapped_kv",
    "random_tokens", "shm_names", "stall_proxy", "views_at",
]

DIGEST_CASES = [(248, 0, 0), (1024, 8, 2**64 - 1), (1088, 56, 0x9F9F9F9F9F9F9F9F),
                (2056, 0, 1), (3 * 1024 + 960, 8, 0), (16 * 1024 + 64, 56, 2**63 + 5),
                (40 * 1024 + 8, 8, 3)]
"""(payload bytes, padding after the checksum, seed) for the checksum kernels: just long
enough for xxh3's long path, one block, a block and a stripe, two blocks and a word, a
partial block of 15 stripes, 16 blocks and a stripe, and 40 blocks and a word (the GPU
walks a row's blocks in chunks of ``cuda_digests.CHUNK``, then the rest one by one); rows
apart by none, a word and 56 bytes."""


def views_at(runs: list[Run], count: int) -> list[torch.Tensor | None]:
    """Per position of a batch of ``count``, its value's view in ``runs`` (None: none)."""
    views: list[torch.Tensor | None] = [None] * count
    for run in runs:
        views[run.first : run.first + run.count] = run.rows.unbind(0)
    return views


def shm_names() -> set[str]:
    """Names in /dev/shm that shared KV memory (ours, or torch's) would leave behind."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(("kvsidecar", "torch_"))}


def mapped_kv(pid: int) -> set[str]:
    """The inodes of shared KV memory mapped into process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[4] for line in maps if "/memfd:kvsidecar" in line}


@contextlib.contextmanager
def engine_process(script: str, endpoint: str) -> Iterator[subprocess.Popen[str]]:
    """An engine in a process of its own, running ``script`` (given the endpoint as
    ``argv[1]``) from the repository root; entered once it prints ``registered``, and
    killed on the way out."""
    root = Path(__file__).resolve().parents[2]
    engine = subprocess.Popen([sys.executable, "-c", script, endpoint],
                              stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "registered"
        yield engine
    finally:
        engine.kill()
        engine.wait()
        if engine.stdout is not None:
            engine.stdout.close()


def random_tokens(count: int, seed: int = 0) -> list[int]:
    """Reproducible token ids."""
    rng = random.Random(seed)
    return [rng.randrange(1, 32_000) for _ in range(count)]


class KVEngine:
    """A minimal engine's KV memory: one blocks-first shared tensor per layer, random bytes."""

    def __init__(self, layout: Mapping[str, Any], num_blocks: int = 64) -> None:
        self.layout = KVCacheLayout.from_dict(layout)
        self.kv_caches = shared_kv_caches(self.layout, num_blocks)
        for tensor in self.kv_caches.values():
            tensor.normal_()

    def pages(self, kv_group_id: int, block_id: int) -> list[torch.Tensor]:
        """Copies of one block's pages, layer by layer."""
        return [
            self.kv_caches[layer][block_id].clone()
            for layer in self.layout.groups[kv_group_id].layers
        ]

    def same_block(self, kv_group_id: int, block_a: int, other: KVEngine, block_b: int) -> bool:
        return all(
            torch.equal(x, y)
            for x, y in zip(
                self.pages(kv_group_id, block_a), other.pages(kv_group_id, block_b), strict=True
            )
        )

    async def connect(self, endpoint: str, **kwargs: Any) -> EngineClient:
        return await EngineClient.connect(
            endpoint, layout=self.layout, kv_caches=self.kv_caches, **kwargs
        )


def hybrid_layout(
    *,
    block_size: int = 16,
    ring: int = 4,
    page_bytes: int = 4096,
    model: str = "test-model",
    layers_per_group: int = 2,
    mamba_mode: str = "align",
    **extra: Any,
) -> dict[str, Any]:
    """A small Qwen3-Next-style layout dict: full attention + QSA ring + mamba."""

    def layers(prefix: str) -> list[str]:
        return [f"{prefix}.{i}" for i in range(layers_per_group)]

    return {
        "model": model,
        "groups": [
            {
                "kind": "full_attention",
                "block_size": block_size,
                "layers": layers("attn"),
                "page_bytes": page_bytes,
            },
            {
                "kind": "circular_buffer",
                "block_size": ring,
                "layers": layers("ring"),
                "page_bytes": page_bytes,
            },
            {
                "kind": "mamba",
                "block_size": block_size,
                "mamba_cache_mode": mamba_mode,
                "layers": layers("mamba"),
                "page_bytes": page_bytes,
            },
        ],
        **extra,
    }


class StallProxy:
    """``stall_proxy.py`` in its own process: a relay that can be told to hang."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self._stdout = BufferedByteReceiveStream(process.stdout)
        self._stdin = process.stdin

    async def command(self, command: str) -> str:
        """``stall`` or ``resume``; returns once it has taken effect."""
        await self._stdin.send(f"{command}\n".encode())
        return await self.answer()

    async def answer(self) -> str:
        return (await self._stdout.receive_until(b"\n", 1024)).decode()


@contextlib.asynccontextmanager
async def stall_proxy(upstream: str) -> AsyncIterator[tuple[StallProxy, str]]:
    """A stallable relay to ``upstream`` (host:port) and the address to reach it at."""
    command = [sys.executable, str(Path(__file__).with_name("stall_proxy.py")), upstream]
    async with await anyio.open_process(command) as process:
        proxy = StallProxy(process)
        try:
            port = int((await proxy.answer()).split()[1])
            yield proxy, f"127.0.0.1:{port}"
        finally:
            process.kill()
