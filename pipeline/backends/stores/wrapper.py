"""The base of store decorators (circuit breaker, fault points): every call of the
wrapped store goes through one overridable hook, piecewise puts and gets included."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import torch

from pipeline.core.outcomes import KeyOutcome
from pipeline.core.store import (
    DirectKVStore,
    Extents,
    KVStore,
    Pieces,
    PiecewiseKVStore,
    Presence,
    ReadHere,
    Seal,
    ValueScope,
)

__all__ = ["StoreWrapper"]

T = TypeVar("T")


class StoreWrapper:
    """A store around another: each call goes through ``_around(name, call)``, which a
    subclass overrides to guard it (timeouts, fault points); lent memory is passed on."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        # Resolved once: a runtime protocol check costs more than the calls it guards.
        self._lender = inner if isinstance(inner, DirectKVStore) else None
        self._piecewise = inner if isinstance(inner, PiecewiseKVStore) else None

    async def _around(self, name: str, call: Callable[[], Awaitable[T]]) -> T:
        return await call()

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        await self.inner.register_buffer(buffer)

    async def exists(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Presence]:
        return await self._around("exists", lambda: self.inner.exists(keys, sizes))

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

    async def reserve(self, keys: Sequence[str], size: int, *,
                      scope: ValueScope | None = None) -> Extents:
        return await self._around("put", lambda: self._direct().reserve(keys, size,
                                                                         scope=scope))

    def commit(self, extents: Extents, *, written: bool) -> list[KeyOutcome]:
        return self._direct().commit(extents, written=written)

    async def lease(self, keys: Sequence[str], size: int, *,
                    scope: ValueScope | None = None) -> Extents:
        return await self._around("get", lambda: self._direct().lease(keys, size,
                                                                       scope=scope))

    def release(self, extents: Extents) -> None:
        self._direct().release(extents)

    def register_memory(self, memory: torch.Tensor) -> None:
        self._pieces().register_memory(memory)

    def unregister_memory(self, memory: torch.Tensor) -> None:
        self._pieces().unregister_memory(memory)

    def when_calls_returned(self, callback: Callable[[], None]) -> None:
        self._pieces().when_calls_returned(callback)

    async def put_pieces(
        self, keys: Sequence[str], values: Pieces, *, seal: Seal | None = None
    ) -> list[KeyOutcome]:
        return await self._around(
            "put", lambda: self._pieces().put_pieces(keys, values, seal=seal))

    async def get_pieces_into(
        self, keys: Sequence[str], buffers: Pieces, *, measure: Seal | None = None,
        read: ReadHere | None = None,
    ) -> list[KeyOutcome]:
        return await self._around(
            "get", lambda: self._pieces().get_pieces_into(keys, buffers, measure=measure,
                                                          read=read))

    def _pieces(self) -> PiecewiseKVStore:
        if self._piecewise is None:
            raise TypeError(f"{type(self.inner).__name__} does not move values in pieces")
        return self._piecewise

    def _direct(self) -> DirectKVStore:
        if self._lender is None:
            raise TypeError(f"{type(self.inner).__name__} does not lend its memory")
        return self._lender

