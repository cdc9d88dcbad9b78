"""Helpers for testing code that talks to a sidecar: a real sidecar process, small layouts.

Shipped with the library so engine integrations can test against the real thing.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

from pipeline.config import Config
from pipeline.layout import KVCacheLayout

__all__ = [
    "KVEngine",
    "SidecarProcess",
    "StallProxy",
    "hybrid_layout",
    "random_tokens",
    "run_sidecar_process",
    "stall_proxy",
]


def random_tokens(count: int, seed: int = 0) -> list[int]:
    """Reproducible token ids."""
    rng = random.Random(seed)
    return [rng.randrange(1, 32_000) for _ in range(count)]


class KVEngine:
    """A minimal engine's KV memory: one blocks-first shared tensor per layer, random bytes."""

    def __init__(self, layout: Mapping[str, Any], num_blocks: int = 64) -> None:
        from transport.tensors import shared_kv_caches

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

    async def connect(self, endpoint: str, **kwargs: Any) -> Any:
        from transport.client import EngineClient

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


class SidecarProcess:
    """A ``kvsidecar serve`` child process on a private ipc:// endpoint."""

    def __init__(self, process: subprocess.Popen[bytes], endpoint: str, log_path: Path) -> None:
        self.process = process
        self.endpoint = endpoint
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            base[key] = _merge(base[key], value)
        else:
            base[key] = value
    return base


@contextlib.contextmanager
def run_sidecar_process(
    overrides: Mapping[str, Any] | None = None, *, startup_timeout_s: float = 30.0
) -> Iterator[SidecarProcess]:
    """Start a sidecar with the default config plus ``overrides`` (a nested dict).

    The sidecar is stopped (SIGTERM, then SIGKILL) when the block exits.
    """
    with tempfile.TemporaryDirectory(prefix="kvsidecar-test-") as tmp:
        socket_path = Path(tmp) / "sidecar.sock"
        config: dict[str, Any] = _merge(
            {"server": {"endpoint": f"ipc://{socket_path}"}, "logging": {"format": "json"}},
            overrides or {},
        )
        msgspec.convert(config, Config)  # fail here, in the test, on a bad override
        config_path = Path(tmp) / "config.yaml"
        config_path.write_bytes(msgspec.yaml.encode(config))
        log_path = Path(tmp) / "sidecar.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "serve", "--config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ},
            )
        sidecar = SidecarProcess(process, config["server"]["endpoint"], log_path)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while b"sidecar.ready" not in log_path.read_bytes():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"sidecar exited with {process.returncode}:\n{sidecar.log()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"sidecar not ready in {startup_timeout_s}s:\n{sidecar.log()}"
                    )
                time.sleep(0.02)
            yield sidecar
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                sidecar.terminate(timeout_s=15)


class StallProxy:
    """``pipeline.stall_proxy`` in its own process: a relay that can be told to hang."""

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
    command = [sys.executable, "-m", "pipeline.stall_proxy", upstream]
    async with await anyio.open_process(command) as process:
        proxy = StallProxy(process)
        try:
            port = int((await proxy.answer()).split()[1])
            yield proxy, f"127.0.0.1:{port}"
        finally:
            process.kill()
