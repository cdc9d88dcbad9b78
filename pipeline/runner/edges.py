"""Edges: the bounded streams between stages, each with a named end per side.

Every item is stamped when it is sent, so the edge knows how long each item waited
in it (``Edge.on_wait`` hears each wait, in seconds, as the item is taken out).

A send with room does not yield to the event loop (anyio's ``send`` always does: one
loop trip per item per edge). Each worker still yields once per item, in ``receive``,
so no stage can starve the others.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Generic, Self, TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import (
    MemoryObjectReceiveStream,
    MemoryObjectSendStream,
    MemoryObjectStreamStatistics,
)

__all__ = ["Edge", "EdgeReceiveStream", "EdgeSendStream", "create_edge"]

T = TypeVar("T")
Stamped = tuple[float, T]


def _ignore(seconds: float) -> None:
    pass


S = TypeVar("S", bound="MemoryObjectSendStream[Any] | MemoryObjectReceiveStream[Any]")


class _EdgeEnd(Generic[S]):
    """What both ends of an edge share: closing (``with`` closes too, as anyio's memory
    streams do) and the statistics of the stream underneath."""

    _stream: S
    closed = False
    """Whether this end was closed (its clones are ends of their own)."""

    def close(self) -> None:
        self.closed = True
        self._stream.close()

    async def aclose(self) -> None:
        self.close()

    def statistics(self) -> MemoryObjectStreamStatistics:
        return self._stream.statistics()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclasses.dataclass(slots=True)
class _Waits:
    """Where an edge's waits go; shared by every clone of its receiving end."""

    observe: Callable[[float], None] = _ignore


class EdgeSendStream(_EdgeEnd[MemoryObjectSendStream[Stamped[T]]], ObjectSendStream[T]):
    """An edge's sending end: a memory object stream that stamps what it sends."""

    def __init__(self, stream: MemoryObjectSendStream[Stamped[T]]) -> None:
        self._stream = stream

    async def send(self, item: T) -> None:
        """Send, waiting for room. With room there is no trip through the event loop: the
        sender goes on, and the next stage runs when the sender next waits."""
        stamped = (time.monotonic(), item)
        try:
            self._stream.send_nowait(stamped)
        except anyio.WouldBlock:
            await self._stream.send(stamped)

    def send_nowait(self, item: T) -> None:
        self._stream.send_nowait((time.monotonic(), item))

    def clone(self) -> EdgeSendStream[T]:
        return EdgeSendStream(self._stream.clone())


class EdgeReceiveStream(_EdgeEnd[MemoryObjectReceiveStream[Stamped[T]]],
                        ObjectReceiveStream[T]):
    """An edge's receiving end: reports each item's wait as it takes it out."""

    def __init__(self, stream: MemoryObjectReceiveStream[Stamped[T]], waits: _Waits) -> None:
        self._stream = stream
        self._waits = waits

    async def receive(self) -> T:
        sent_at, item = await self._stream.receive()
        self._waits.observe(time.monotonic() - sent_at)
        return item

    def receive_nowait(self) -> T:
        sent_at, item = self._stream.receive_nowait()
        self._waits.observe(time.monotonic() - sent_at)
        return item

    def clone(self) -> EdgeReceiveStream[T]:
        return EdgeReceiveStream(self._stream.clone(), self._waits)


@dataclasses.dataclass(frozen=True, slots=True)
class Edge(Generic[T]):
    """A bounded stream from one stage to the next: the producer's ``outbox``, the
    consumer's ``inbox``."""

    outbox: EdgeSendStream[T]
    inbox: EdgeReceiveStream[T]
    size: int
    _waits: _Waits

    def queued(self) -> int:
        """Items sent and not yet taken out."""
        return self.outbox.statistics().current_buffer_used

    def on_wait(self, observe: Callable[[float], None]) -> None:
        """Hear how long each item waited in the edge (seconds), as it is taken out."""
        self._waits.observe = observe

    def close(self) -> None:
        self.outbox.close()
        self.inbox.close()


def create_edge(size: int) -> Edge[T]:
    """A bounded edge (``size`` comes from config, never infinite)."""
    if not 0 < size < math.inf:
        raise ValueError(f"edge size must be finite and positive, got {size}")
    outbox, inbox = anyio.create_memory_object_stream[Stamped[T]](max_buffer_size=size)
    waits = _Waits()
    return Edge(EdgeSendStream(outbox), EdgeReceiveStream(inbox, waits), size, waits)
