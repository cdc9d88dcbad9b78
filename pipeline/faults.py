"""Fault injection: named fault points in the stages and around the store, from config.

A point fires with a configured probability (seeded, so a run is reproducible): it may
delay, raise ``InjectedFault`` (an expected, per-item failure), or — at ``store.put`` /
``store.get`` — corrupt a value as stored or as loaded, which the integrity check must
catch. With no points
configured every check is a dictionary miss.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import anyio
import torch

from pipeline.config import FaultsConfig
from pipeline.errors import StoreError
from pipeline.store import DirectKVStore, Extents, KeyOutcome, KVStore, direct_store

__all__ = ["Faults", "FaultyStore", "InjectedFault"]


class InjectedFault(StoreError):
    """A failure injected at a fault point (a store error, so every layer handles it)."""


class Faults:
    def __init__(self, config: FaultsConfig) -> None:
        self._points = dict(config.points)
        self._rng = random.Random(config.seed)
        self.fired: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._points)

    async def check(self, name: str) -> None:
        """Delay and maybe fail at fault point ``name``."""
        point = self._points.get(name)
        if point is None:
            return
        if point.delay_ms:
            await anyio.sleep(point.delay_ms / 1000)
        if point.error_rate and self._rng.random() < point.error_rate:
            self.fired[name] = self.fired.get(name, 0) + 1
            raise InjectedFault(f"injected fault at {name}")

    def corrupt(self, name: str, buffers: Sequence[torch.Tensor]) -> None:
        point = self._points.get(name)
        if point is None or not point.corrupt_rate:
            return
        for buffer in buffers:
            if buffer.numel() and self._rng.random() < point.corrupt_rate:
                self.fired[f"{name}.corrupt"] = self.fired.get(f"{name}.corrupt", 0) + 1
                buffer[self._rng.randrange(buffer.numel())] ^= 0x5A


class FaultyStore:
    """A store with fault points ``store.exists`` / ``store.put`` / ``store.get``."""

    def __init__(self, inner: KVStore, faults: Faults) -> None:
        self.inner = inner
        self._faults = faults

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        await self.inner.register_buffer(buffer)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        await self._faults.check("store.exists")
        return await self.inner.exists(keys)

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        await self._faults.check("store.put")
        self._faults.corrupt("store.put", values)  # the value as stored
        return await self.inner.put(keys, values)

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        await self._faults.check("store.get")
        outcomes = await self.inner.get_into(keys, buffers)
        self._faults.corrupt("store.get", buffers)
        return outcomes

    async def remove(self, keys: Sequence[str]) -> int:
        return await self.inner.remove(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()

    # -- DirectKVStore, when the wrapped store lends its memory --------------------------

    @property
    def lends_memory(self) -> bool:
        return direct_store(self.inner) is not None

    async def reserve(self, keys: Sequence[str], size: int) -> Extents:
        await self._faults.check("store.put")
        return await self._direct().reserve(keys, size)

    def commit(self, extents: Extents, *, written: bool) -> list[KeyOutcome]:
        if written:  # the value as stored
            self._faults.corrupt("store.put", [v for v in extents.views if v is not None])
        return self._direct().commit(extents, written=written)

    async def lease(self, keys: Sequence[str], size: int) -> Extents:
        await self._faults.check("store.get")
        # Leased memory is shared by concurrent readers: corruption at rest is injected
        # at store.put; store.get corrupts only copies (copying backends).
        return await self._direct().lease(keys, size)

    def release(self, extents: Extents) -> None:
        self._direct().release(extents)

    def _direct(self) -> DirectKVStore:
        direct = direct_store(self.inner)
        assert direct is not None, "only called when lends_memory"
        return direct
