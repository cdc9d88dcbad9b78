"""Fault injection: named fault points in the stages and around the store, from config.

A point fires with a configured probability (seeded, so a run is reproducible): it may
delay, raise ``InjectedFault`` (an expected, per-item failure), or — at ``store.put`` /
``store.get`` — corrupt a value as stored or as loaded, which the integrity check must
catch. A value moved in pieces straight from and into engine memory is corrupted in its
trailer, the checksum the sidecar keeps with it, never in the engine's memory: without
checksums such values are not corrupted. With no points configured every check is a
dictionary miss.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
import torch

from pipeline.backends.stores.wrapper import StoreWrapper
from pipeline.core.config import FaultsConfig
from pipeline.core.errors import StoreError
from pipeline.core.outcomes import STORED, KeyOutcome
from pipeline.core.runs import value_views
from pipeline.core.store import Extents, KVStore, Pieces, ReadHere, Seal, ValueScope

__all__ = ["Faults", "FaultyStore", "InjectedBug", "InjectedFault"]

T = TypeVar("T")


class InjectedFault(StoreError):
    """A failure injected at a fault point (a store error, so every layer handles it)."""


class InjectedBug(Exception):
    """A failure injected where only a bug could fail (``receive.accepted``: a save or
    load once accepted): what the receiver's guard is there to catch."""


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

    def fires(self, name: str) -> bool:
        """Whether fault point ``name`` fails now (its ``error_rate``), for callers that
        fail in their own way (the disk tier raises an I/O error)."""
        point = self._points.get(name)
        if point is not None and point.error_rate and self._rng.random() < point.error_rate:
            self.fired[name] = self.fired.get(name, 0) + 1
            return True
        return False

    def bug(self, name: str) -> None:
        """Maybe raise ``InjectedBug`` at fault point ``name`` (its ``error_rate``)."""
        point = self._points.get(name)
        if point is not None and point.error_rate and self._rng.random() < point.error_rate:
            self.fired[name] = self.fired.get(name, 0) + 1
            raise InjectedBug(f"injected bug at {name}")

    def corrupt(self, name: str, buffers: Sequence[torch.Tensor],
                keys: Sequence[str] | None = None) -> None:
        """Maybe flip bytes of each buffer (``uint8``), as fault point ``name`` says;
        ``keys``: the buffers' keys, which ``corrupt_key`` filters by (without them, a
        point with a ``corrupt_key`` corrupts nothing)."""
        point = self._points.get(name)
        if point is None or not point.corrupt_rate:
            return
        fired = f"{name}.corrupt"
        for i, buffer in enumerate(buffers):
            if point.corrupt_key and (keys is None or point.corrupt_key not in keys[i]):
                continue
            if point.corrupt_limit and self.fired.get(fired, 0) >= point.corrupt_limit:
                return
            if buffer.numel() and self._rng.random() < point.corrupt_rate:
                self.fired[fired] = self.fired.get(fired, 0) + 1
                size = buffer.numel()
                start = (self._rng.randrange(size) if point.corrupt_at is None
                         else int(point.corrupt_at * size))
                buffer[start : min(size, start + point.corrupt_span)] ^= 0x5A


class FaultyStore(StoreWrapper):
    """A store with fault points ``store.exists`` / ``store.put`` / ``store.get``."""

    def __init__(self, inner: KVStore, faults: Faults) -> None:
        super().__init__(inner)
        self._faults = faults
        self._reserved: dict[Extents, list[str]] = {}
        """Reserved extents' lent keys, in their values' order, until committed."""

    async def _around(self, name: str, call: Callable[[], Awaitable[T]]) -> T:
        await self._faults.check(f"store.{name}")
        return await call()

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        self._faults.corrupt("store.put", values, keys)  # the value as stored
        return await super().put(keys, values)

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        outcomes = await super().get_into(keys, buffers)
        self._faults.corrupt("store.get", buffers, keys)  # the copy this load receives
        return outcomes

    async def put_pieces(
        self, keys: Sequence[str], values: Pieces, *, seal: Seal | None = None
    ) -> list[KeyOutcome]:
        trailers = values.trailers

        def seal_then_corrupt(positions: Sequence[int]) -> None:
            if seal is not None:
                seal(positions)
            if trailers is not None:
                self._faults.corrupt("store.put", [trailers[i] for i in positions],
                                     [keys[i] for i in positions])

        return await super().put_pieces(keys, values, seal=seal_then_corrupt)

    async def get_pieces_into(
        self, keys: Sequence[str], buffers: Pieces, *, measure: Seal | None = None,
        read: ReadHere | None = None,
    ) -> list[KeyOutcome]:
        outcomes = await super().get_pieces_into(keys, buffers, measure=measure, read=read)
        if buffers.trailers is not None:
            self._faults.corrupt("store.get", list(buffers.trailers), keys)
        return outcomes

    async def reserve(self, keys: Sequence[str], size: int, *,
                      scope: ValueScope | None = None) -> Extents:
        extents = await super().reserve(keys, size, scope=scope)
        self._reserved[extents] = [key for key, outcome in zip(keys, extents.outcomes,
                                                              strict=True)
                                   if outcome == STORED]
        return extents

    def commit(self, extents: Extents, *, written: bool) -> list[KeyOutcome]:
        # Lent memory is shared by concurrent readers, so it is corrupted only at rest
        # (here, as stored); store.get corrupts only copies.
        keys = self._reserved.pop(extents, None)
        if written:
            self._faults.corrupt("store.put", value_views(extents.runs), keys)
        return super().commit(extents, written=written)
