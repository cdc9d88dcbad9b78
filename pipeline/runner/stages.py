"""Running stages: workers over bounded edges, the error policy, and the batcher.

Stages know nothing of streams: ``process(item)`` returns the output or None to drop it.
The runner owns the edges. Each worker holds clones of its stage's inbox and of its
outbox (the sending ends of every later inbox it may hand items to) and closes them when
the inbox ends, so ``EndOfStream`` reaches each stage once everything that could feed it
has ended.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Hashable
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup

from pipeline.core.errors import InternalFailure, StoreError
from pipeline.runner.edges import EdgeReceiveStream

__all__ = [
    "Batching", "OnDone", "OnFailure", "Outbox", "Sink", "Stage", "finished_here",
    "run_batcher", "start_stage", "wrapped",
]

In = TypeVar("In", contravariant=True)
Out = TypeVar("Out", covariant=True)
Item = TypeVar("Item")


class Stage(Protocol[In, Out]):
    """What every stage offers the runner: one item in, its output (or None) out."""

    async def process(self, item: In, /) -> Out | None: ...


class Batching(Protocol[Item]):
    """A batching stage: the runner regroups its items (``run_batcher``)."""

    deadline_s: float
    """How long a partial batch may wait for more items."""

    def group_of(self, item: Item, /) -> Hashable:
        """Items of one group share a batch."""

    def limit_of(self, item: Item, /) -> int:
        """How many items fill a batch of this item's group."""

    def new_batch(self) -> list[Item]:
        """An empty batch (the type the next stage takes)."""


MAX_DRAIN = 256
"""Upstream lists taken in at once before the batcher flushes."""

Process = Callable[[Any], Awaitable[Any]]
OnFailure = Callable[[Any, StoreError], Awaitable[Any]]
"""Answers an item whose processing met a store error; what it returns is the stage's
output for that item (None: nothing)."""
Sink = Callable[[Any], Awaitable[None]]
"""Where a path's last outputs go (replies to engines)."""
OnDone = Callable[[str, Any], None]
"""Hears ``(stage, item)`` each time a stage has processed an item (before its output
is passed on): how requests are traced through the stages."""


def _guarded(process: Process, on_failure: OnFailure | None,
             before: Callable[[], Awaitable[None]] | None) -> Process:
    """``process`` with the error policy: a per-item failure (a store error, an injected
    fault) is handed to ``on_failure`` and the stage goes on; so is any other exception,
    as an ``InternalFailure`` (a bug, answered rather than ending every engine's
    service). Without ``on_failure`` it propagates and ends the service."""
    if on_failure is None and before is None:
        return process

    async def guarded(item: Any) -> Any:
        try:
            if before is not None:
                await before()
            return await process(item)
        except StoreError as exc:
            if on_failure is None:
                raise
            return await on_failure(item, exc)
        except Exception as exc:
            if on_failure is None:
                raise
            failure = InternalFailure(f"{type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            return await on_failure(item, failure)

    return guarded


_finishing: ContextVar[Callable[[Any], None] | None] = ContextVar("finishing", default=None)
"""Tells the tracer that the stage this task is running has done its part of an item."""


def finished_here(item: Any) -> None:
    """The stage this task is running has done its part of ``item`` (a request it
    finished, about to be answered from inside it): trace it now, not only once the
    stage returns, which is after the reply."""
    trace = _finishing.get()
    if trace is not None:
        trace(item)


def _traced(process: Process, name: str, on_done: OnDone | None) -> Process:
    if on_done is None:
        return process
    trace = functools.partial(on_done, name)

    async def traced(item: Any) -> Any:
        token = _finishing.set(trace)
        try:
            result = await process(item)
        finally:
            _finishing.reset(token)
        trace(item)
        return result

    return traced


def wrapped(
    process: Process, name: str, *, on_failure: OnFailure | None = None,
    before: Callable[[], Awaitable[None]] | None = None, on_done: OnDone | None = None,
) -> Process:
    """``process`` as a stage's workers run it: ``before`` ahead of every item, store
    errors answered by ``on_failure``, ``on_done(name, item)`` told of each item."""
    return _traced(_guarded(process, on_failure, before), name, on_done)


class Outbox(Protocol):
    """Where a stage's outputs go: the next stage's inbox (``EdgeSendStream``), or
    anything that passes them on as the graph does; closed by its holder, cloned per
    worker."""

    async def send(self, item: Any, /) -> None: ...

    def clone(self) -> Outbox: ...

    def close(self) -> None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: Any) -> Any: ...


async def _worker(
    process: Process,
    inbox: EdgeReceiveStream[Any],
    outbox: Outbox | None,
    sink: Sink | None,
) -> None:
    async with inbox:
        if outbox is None:
            async for item in inbox:
                result = await process(item)
                if result is not None and sink is not None:
                    await sink(result)
            return
        async with outbox:
            async for item in inbox:
                result = await process(item)
                if result is not None:
                    await outbox.send(result)


def start_stage(
    tg: TaskGroup,
    name: str,
    process: Process,
    inbox: EdgeReceiveStream[Any],
    outbox: Outbox | None,
    *,
    workers: int = 1,
    on_failure: OnFailure | None = None,
    before: Callable[[], Awaitable[None]] | None = None,
    sink: Sink | None = None,
    on_done: OnDone | None = None,
) -> None:
    """Run ``workers`` copies of a stage; the originals of both streams are closed here.

    ``before`` runs ahead of every item (a fault point); ``on_failure(item, error)``
    answers an item whose processing met a store error; ``on_done(name, item)`` hears
    each item processed. Without an outbox, outputs go to ``sink`` (if any).
    """
    guarded = wrapped(process, name, on_failure=on_failure, before=before, on_done=on_done)
    for index in range(workers):
        tg.start_soon(
            _worker, guarded, inbox.clone(), outbox.clone() if outbox else None, sink,
            name=f"stage.{name}.{index}",
        )
    inbox.close()
    if outbox is not None:
        outbox.close()


async def run_batcher(
    inbox: EdgeReceiveStream[list[Item]],
    outbox: Outbox,
    *,
    group_of: Callable[[Item], Hashable],
    limit_of: Callable[[Item], int],
    deadline_s: float,
    new_batch: Callable[[], list[Item]] = list,
) -> None:
    """Regroup items into batches of one group each, flushed when full or when the oldest
    item has waited ``deadline_s``. ``limit_of`` gives the item count that fills a batch
    (asked of its first item: items of one group share it).
    Items already queued are always taken in before flushing, so with ``deadline_s`` 0
    batches are as large as the backlog allows and an idle pipeline adds no delay.

    Input items arrive in lists (one list per upstream job); output is one list per batch.
    """
    pending: dict[Hashable, tuple[list[Item], int]] = {}  # group -> (batch, its limit)
    started: dict[Hashable, float] = {}
    async with inbox, outbox:
        while True:
            received: list[list[Item]] = []
            ended = False
            try:
                if started:
                    timeout = min(started.values()) + deadline_s - anyio.current_time()
                    with anyio.move_on_after(max(0.0, timeout)):
                        received.append(await inbox.receive())
                else:  # nothing waits on a deadline: no cancel scope to pay for
                    received.append(await inbox.receive())
            except anyio.EndOfStream:
                ended = True
            # Whatever is queued already joins this round: batches fill without waiting.
            while received and not ended and len(received) < MAX_DRAIN:
                try:
                    received.append(inbox.receive_nowait())
                except anyio.WouldBlock:
                    break
                except anyio.EndOfStream:
                    ended = True
            for item in (item for items in received for item in items):
                key = group_of(item)
                entry = pending.get(key)
                if entry is None:
                    entry = pending[key] = (new_batch(), limit_of(item))
                    started[key] = anyio.current_time()
                batch, limit = entry
                batch.append(item)
                if len(batch) >= limit:
                    del pending[key], started[key]
                    await outbox.send(batch)
            now = anyio.current_time()
            for key in [k for k, t in started.items() if ended or now - t >= deadline_s]:
                batch, _ = pending.pop(key)
                del started[key]
                await outbox.send(batch)
            if ended:
                return
