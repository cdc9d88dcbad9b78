"""Edges: the bounded streams between stages, each with a named end per side.

Every item is stamped when it is sent, so the edge knows how long each item waited
in it (``Edge.on_wait`` hears each wait, in seconds, as the item is taken out).

An edge is a bounded queue on the event loop's own futures, with the ends, clones and
errors of anyio's memory object streams (``WouldBlock``, ``EndOfStream`` once every
sending end is closed and the queue is empty, ``ClosedResourceError``,
``BrokenResourceError``). It is not one of them: their receive builds an event and a
waiter per item and yields to the event loop twice when it has to wait, about 14 µs of
the loop's CPU per hop against 5 here (measured through 7 stages, one item at a time),
and every request crosses 5 to 7 edges. A send with room does not yield to the event
loop: the sender goes on, and the next stage runs when the sender next waits. Each
receive still yields once per item, so no stage can starve the others.

Items are never handed to a waiting task, only left in the queue: a waiter that is
woken and then cancelled loses nothing, and passes its wake-up on. A woken task looks
again (another may have been quicker), so waking too many is harmless; closing an end
wakes every task waiting on its side.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Generic, Self, TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import MemoryObjectStreamStatistics

__all__ = ["Edge", "EdgeReceiveStream", "EdgeSendStream", "create_edge"]

T = TypeVar("T")
Stamped = tuple[float, T]


def _ignore(seconds: float) -> None:
    pass


class _Waiters(collections.deque["asyncio.Future[None]"]):
    """Tasks waiting for an edge to change (an item, room, or an end closed)."""

    async def wait(self) -> None:
        """Until woken. Cancelled after being woken, the wake-up goes to the next."""
        future = asyncio.get_running_loop().create_future()
        self.append(future)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.wake_one()
            raise

    def wake_one(self) -> None:
        while self:
            future = self.popleft()
            if not future.done():  # (one cancelled while waiting stays until here)
                future.set_result(None)
                return

    def wake_all(self) -> None:
        while self:
            self.wake_one()

    def waiting(self) -> int:
        return sum(not future.done() for future in self)


class _Queue(Generic[T]):
    """What an edge's ends share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: collections.deque[Stamped[T]] = collections.deque()
        self.senders = 0
        """Open sending ends."""
        self.receivers = 0
        """Open receiving ends."""
        self.waiting_to_send = _Waiters()
        self.waiting_to_receive = _Waiters()

    def statistics(self) -> MemoryObjectStreamStatistics:
        return MemoryObjectStreamStatistics(
            current_buffer_used=len(self.items), max_buffer_size=self.size,
            open_send_streams=self.senders, open_receive_streams=self.receivers,
            tasks_waiting_send=self.waiting_to_send.waiting(),
            tasks_waiting_receive=self.waiting_to_receive.waiting(),
        )


class _EdgeEnd:
    """What both ends of an edge share: closing (``with`` closes too, as anyio's memory
    streams do) and the statistics of the queue."""

    _queue: _Queue[Any]
    _closed: bool

    def close(self) -> None:
        """Close this end (idempotent); the edge lives while a clone of each end is open."""
        if not self._closed:
            self._closed = True
            self._closed_one()

    async def aclose(self) -> None:
        self.close()

    def statistics(self) -> MemoryObjectStreamStatistics:
        return self._queue.statistics()

    def _closed_one(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclasses.dataclass(slots=True)
class _Waits:
    """Where an edge's waits go; shared by every clone of its receiving end."""

    observe: Callable[[float], None] = _ignore


class EdgeSendStream(_EdgeEnd, ObjectSendStream[T]):
    """An edge's sending end: stamps what it sends."""

    _queue: _Queue[T]

    def __init__(self, queue: _Queue[T]) -> None:
        self._queue = queue
        self._closed = False
        queue.senders += 1

    async def send(self, item: T) -> None:
        """Send, waiting for room. With room there is no trip through the event loop: the
        sender goes on, and the next stage runs when the sender next waits."""
        stamped = (time.monotonic(), item)
        while True:
            try:
                self._put(stamped)
                return
            except anyio.WouldBlock:
                await self._queue.waiting_to_send.wait()

    def send_nowait(self, item: T) -> None:
        self._put((time.monotonic(), item))

    def _put(self, stamped: Stamped[T]) -> None:
        queue = self._queue
        if self._closed:
            raise anyio.ClosedResourceError
        if not queue.receivers:
            raise anyio.BrokenResourceError
        if len(queue.items) >= queue.size:
            raise anyio.WouldBlock
        queue.items.append(stamped)
        queue.waiting_to_receive.wake_one()

    def clone(self) -> EdgeSendStream[T]:
        if self._closed:
            raise anyio.ClosedResourceError
        return EdgeSendStream(self._queue)

    def _closed_one(self) -> None:
        queue = self._queue
        queue.senders -= 1
        queue.waiting_to_send.wake_all()  # a task sending through this end finds it closed
        if not queue.senders:  # receivers drain what is left, then end
            queue.waiting_to_receive.wake_all()


class EdgeReceiveStream(_EdgeEnd, ObjectReceiveStream[T]):
    """An edge's receiving end: reports each item's wait as it takes it out."""

    _queue: _Queue[T]

    def __init__(self, queue: _Queue[T], waits: _Waits) -> None:
        self._queue = queue
        self._closed = False
        self._waits = waits
        queue.receivers += 1

    async def receive(self) -> T:
        if self._queue.items:
            await asyncio.sleep(0)  # once per item: no stage starves the others
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                await self._queue.waiting_to_receive.wait()

    def receive_nowait(self) -> T:
        queue = self._queue
        if self._closed:
            raise anyio.ClosedResourceError
        if not queue.items:
            raise anyio.EndOfStream if not queue.senders else anyio.WouldBlock
        sent_at, item = queue.items.popleft()
        queue.waiting_to_send.wake_one()
        self._waits.observe(time.monotonic() - sent_at)
        return item

    def clone(self) -> EdgeReceiveStream[T]:
        if self._closed:
            raise anyio.ClosedResourceError
        return EdgeReceiveStream(self._queue, self._waits)

    def _closed_one(self) -> None:
        queue = self._queue
        queue.receivers -= 1
        queue.waiting_to_receive.wake_all()  # a task receiving through this end finds it closed
        if not queue.receivers:  # senders find the edge broken
            queue.waiting_to_send.wake_all()


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

    def bypassed(self) -> None:
        """An item went past the edge without entering it (run inline): it waited 0 s."""
        self._waits.observe(0.0)

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
    queue: _Queue[T] = _Queue(size)
    waits = _Waits()
    return Edge(EdgeSendStream(queue), EdgeReceiveStream(queue, waits), size, waits)
