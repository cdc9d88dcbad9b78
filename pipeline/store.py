"""The block-store contract every backend implements (embedded, Mooncake, test fakes).

A value is one stored block: a contiguous byte range inside a staging buffer that was
registered with the store once (zero-copy backends register it for DMA). Every batch
call returns one outcome per key, in order; a backend raises ``StoreError`` only when
the store as a whole is unusable (down, closed), never for a single key.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import msgspec
import torch

from pipeline.errors import StoreError, StoreUnavailable

__all__ = ["BlockStatus", "DirectKVStore", "Extents", "KVStore", "KeyOutcome",
           "StoreWrapper", "direct_store"]


class BlockStatus(enum.StrEnum):
    STORED = "stored"
    PRESENT = "present"
    SKIPPED = "skipped"
    FAILED = "failed"
    LOADED = "loaded"
    MISSING = "missing"


class KeyOutcome(msgspec.Struct, frozen=True):
    status: BlockStatus
    reason: str = ""


STORED = KeyOutcome(BlockStatus.STORED)
PRESENT = KeyOutcome(BlockStatus.PRESENT)
LOADED = KeyOutcome(BlockStatus.LOADED)
MISSING = KeyOutcome(BlockStatus.MISSING, "missing")
STORE_FULL = KeyOutcome(BlockStatus.SKIPPED, "store_full")


def failed(reason: str) -> KeyOutcome:
    return KeyOutcome(BlockStatus.FAILED, reason)


STORE_UNAVAILABLE = KeyOutcome(BlockStatus.SKIPPED, "store_unavailable")


def store_error_outcome(exc: StoreError, *, saving: bool) -> KeyOutcome:
    """The outcome of blocks whose whole batch met a store error.

    Saves are a cache fill: while the store is known to be down they are skipped.
    """
    if saving and isinstance(exc, StoreUnavailable):
        return STORE_UNAVAILABLE
    return failed(f"store: {exc}")


@runtime_checkable
class KVStore(Protocol):
    """A byte store keyed by strings; all methods are safe to call from the event loop."""

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register a staging buffer (1-D uint8, contiguous) that values will live in."""

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored and readable."""

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        """Store each value (a 1-D uint8 slice of a registered buffer) under its key.

        Outcomes: ``STORED``, ``PRESENT`` (the key existed: not overwritten),
        ``STORE_FULL`` (skipped: no room), or ``failed(reason)``.
        """

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        """Copy each key's value into its buffer (a 1-D uint8 slice of a registered buffer).

        Outcomes: ``LOADED``, ``MISSING``, or ``failed(reason)`` (a size mismatch is a
        failure). A buffer whose outcome is not ``LOADED`` holds undefined bytes.
        """

    async def remove(self, keys: Sequence[str]) -> int:
        """Remove keys if present; return how many were removed."""

    async def aclose(self) -> None:
        """Release the backend's resources; idempotent."""


@dataclasses.dataclass(eq=False, slots=True)
class Extents:
    """Store memory lent for one batch: per key a view (1-D uint8) or the outcome that
    says why there is none. ``handle`` is the backend's own bookkeeping."""

    views: list[torch.Tensor | None]
    outcomes: list[KeyOutcome]
    handle: list[Any]


@runtime_checkable
class DirectKVStore(Protocol):
    """A store whose values live in this process: stages copy straight into and out of
    its memory, one copy instead of two through staging."""

    async def reserve(self, keys: Sequence[str], size: int) -> Extents:
        """Writable, not yet readable extents of ``size`` bytes for new keys (outcome
        ``STORED`` once committed); present keys and a full store say so instead."""

    def commit(self, extents: Extents, *, written: bool) -> list[KeyOutcome]:
        """Make reserved extents readable (``written``) or give them back."""

    async def lease(self, keys: Sequence[str], size: int) -> Extents:
        """Pinned, readable extents of stored values (outcome ``LOADED``)."""

    def release(self, extents: Extents) -> None:
        """End a lease; the store may evict those values again."""


def direct_store(store: KVStore) -> DirectKVStore | None:
    """The store itself if it lends its memory (through wrappers that say so), else None."""
    return store if getattr(store, "lends_memory", False) else None  # type: ignore[return-value]


T = TypeVar("T")


class StoreWrapper:
    """A store around another: each call goes through ``_around(name, call)``, which a
    subclass overrides to guard it (timeouts, fault points); lent memory is passed on."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner

    async def _around(self, name: str, call: Callable[[], Awaitable[T]]) -> T:
        return await call()

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        await self.inner.register_buffer(buffer)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self._around("exists", lambda: self.inner.exists(keys))

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        return await self._around("put", lambda: self.inner.put(keys, values))

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        return await self._around("get", lambda: self.inner.get_into(keys, buffers))

    async def remove(self, keys: Sequence[str]) -> int:
        return await self._around("remove", lambda: self.inner.remove(keys))

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def lends_memory(self) -> bool:
        return direct_store(self.inner) is not None

    async def reserve(self, keys: Sequence[str], size: int) -> Extents:
        return await self._around("put", lambda: self._direct().reserve(keys, size))

    def commit(self, extents: Extents, *, written: bool) -> list[KeyOutcome]:
        return self._direct().commit(extents, written=written)

    async def lease(self, keys: Sequence[str], size: int) -> Extents:
        return await self._around("get", lambda: self._direct().lease(keys, size))

    def release(self, extents: Extents) -> None:
        self._direct().release(extents)

    def _direct(self) -> DirectKVStore:
        direct = direct_store(self.inner)
        if direct is None:
            raise TypeError(f"{type(self.inner).__name__} does not lend its memory")
        return direct

