"""The stage runner: wires small stages with bounded streams, workers and batch deadlines.

Stages know nothing of streams: ``process(item)`` returns the output or None to drop it.
The runner owns the edges. Each worker holds clones of its stage's inbox and outbox and
closes them when the inbox ends, so ``EndOfStream`` cascades stage by stage on drain.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Protocol, TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup

__all__ = ["Edge", "Stage", "create_edge", "run_batcher", "start_stage"]

In = TypeVar("In")
Out = TypeVar("Out")
Item = TypeVar("Item")


class Stage(Protocol[In, Out]):
    async def process(self, item: In) -> Out | None: ...


Edge = tuple[ObjectSendStream[Any], ObjectReceiveStream[Any]]


def create_edge(size: int) -> Edge:
    """A bounded stream between two stages (``size`` comes from config, never infinite)."""
    if not 0 < size < math.inf:
        raise ValueError(f"edge size must be finite and positive, got {size}")
    return anyio.create_memory_object_stream[Any](max_buffer_size=size)


async def _worker(
    process: Callable[[Any], Awaitable[Any]],
    inbox: ObjectReceiveStream[Any],
    outbox: ObjectSendStream[Any] | None,
) -> None:
    async with inbox:
        if outbox is None:
            async for item in inbox:
                await process(item)
            return
        async with outbox:
            async for item in inbox:
                result = await process(item)
                if result is not None:
                    await outbox.send(result)


def start_stage(
    tg: TaskGroup,
    name: str,
    process: Callable[[Any], Awaitable[Any]],
    inbox: ObjectReceiveStream[Any],
    outbox: ObjectSendStream[Any] | None,
    *,
    workers: int = 1,
) -> None:
    """Run ``workers`` copies of a stage; the originals of both streams are closed here."""
    for index in range(workers):
        tg.start_soon(
            _worker, process, inbox.clone(), outbox.clone() if outbox else None,
            name=f"stage.{name}.{index}",
        )
    inbox.close()
    if outbox is not None:
        outbox.close()


async def run_batcher(
    inbox: ObjectReceiveStream[list[Item]],
    outbox: ObjectSendStream[list[Item]],
    *,
    group_of: Callable[[Item], Hashable],
    limit_of: Callable[[Item], int],
    deadline_s: float,
) -> None:
    """Regroup items into batches of one group each, flushed when full or when the oldest
    item has waited ``deadline_s``. ``limit_of`` gives the item count that fills a batch.

    Input items arrive in lists (one list per upstream job); output is one list per batch.
    """
    pending: dict[Hashable, list[Item]] = {}
    started: dict[Hashable, float] = {}
    async with inbox, outbox:
        while True:
            timeout = math.inf
            if started:
                timeout = max(0.0, min(started.values()) + deadline_s - anyio.current_time())
            items: list[Item] | None = None
            ended = False
            with anyio.move_on_after(timeout):
                try:
                    items = await inbox.receive()
                except anyio.EndOfStream:
                    ended = True
            for item in items or ():
                key = group_of(item)
                batch = pending.setdefault(key, [])
                if not batch:
                    started[key] = anyio.current_time()
                batch.append(item)
                if len(batch) >= limit_of(item):
                    del pending[key], started[key]
                    await outbox.send(batch)
            now = anyio.current_time()
            for key in [k for k, t in started.items() if ended or now - t >= deadline_s]:
                batch = pending.pop(key)
                del started[key]
                await outbox.send(batch)
            if ended:
                return
