"""Clients for engine threads that run no event loop: a blocking wrapper with its own
thread, and a lookup client that runs its calls inline on a private loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from pipeline.core.errors import TransportError
from pipeline.core.messages import (
    Registered,
)
from transport.client.engine import EngineClient
from transport.client.results import LoadResult, SaveResult

__all__ = ["BlockingEngineClient", "InlineLookupClient", "PendingLookup"]

_T = TypeVar("_T")


class BlockingEngineClient:
    """The same API for engine threads that do not run an event loop."""

    def __init__(
        self, endpoint: str, *, heartbeat_interval_s: float = 5.0, **connect_kwargs: Any
    ) -> None:
        """Connect like ``EngineClient.connect``; heartbeats run in the client's own thread."""
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._client: EngineClient = self._portal.call(
                lambda: EngineClient.connect(endpoint, **connect_kwargs)
            )
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._heartbeats = self._portal.start_task_soon(
            self._client.run_heartbeats, heartbeat_interval_s
        )

    @property
    def registered(self) -> Registered | None:
        return self._client.registered

    def lookup(self, token_ids: Sequence[int], **request_keys: Any) -> int:
        hit: int = self._portal.call(lambda: self._client.lookup(token_ids, **request_keys))
        return hit

    def save(self, request_id: str, token_ids: Sequence[int],
             block_ids: Sequence[Sequence[int]], **request_keys: Any) -> SaveResult:
        self._client.mark_step()  # on the caller's stream, not the client thread's
        return self._portal.call(
            lambda: self._client.save(request_id, token_ids, block_ids, mark_step=False,
                                      **request_keys)
        )

    def load(self, request_id: str, token_ids: Sequence[int],
             block_ids: Sequence[Sequence[int]], num_tokens: int,
             **request_keys: Any) -> LoadResult:
        return self._portal.call(
            lambda: self._client.load(request_id, token_ids, block_ids, num_tokens,
                                      **request_keys)
        )

    def start_lookup(self, token_ids: Sequence[int], **kwargs: Any) -> Future[int]:
        """``lookup`` without waiting: the result arrives in the future."""
        return self._portal.start_task_soon(functools.partial(self._client.lookup, token_ids,
                                                              **kwargs))

    def start_save(self, request_id: str, token_ids: Sequence[int],
                   block_ids: Sequence[Sequence[int]], **kwargs: Any) -> Future[SaveResult]:
        """``save`` without waiting: the result arrives in the future."""
        self._client.mark_step()
        return self._portal.start_task_soon(
            functools.partial(self._client.save, request_id, token_ids, block_ids,
                              mark_step=False, **kwargs)
        )

    def start_load(self, request_id: str, token_ids: Sequence[int],
                   block_ids: Sequence[Sequence[int]], num_tokens: int,
                   **kwargs: Any) -> Future[LoadResult]:
        """``load`` without waiting: the result arrives in the future."""
        return self._portal.start_task_soon(
            functools.partial(self._client.load, request_id, token_ids, block_ids, num_tokens,
                              **kwargs)
        )

    def close(self) -> None:
        try:
            self._heartbeats.cancel()
            self._portal.call(self._client.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> BlockingEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingLookup:
    """A lookup started by ``InlineLookupClient.start_lookup``: ``result`` and ``done`` as
    a ``concurrent.futures.Future``'s, the lookup progressing only inside ``result``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[int]) -> None:
        self._loop = loop
        self._task = task

    def done(self) -> bool:
        return self._task.done()

    def result(self, timeout: float | None = None) -> int:
        """The hit, waiting up to ``timeout`` for it (``concurrent.futures.TimeoutError``
        after that, the lookup still pending); the lookup's own error is raised."""
        if not self._task.done():
            _run_inline(self._loop, lambda: asyncio.wait((self._task,), timeout=timeout))
        if not self._task.done():
            raise FutureTimeout
        return self._task.result()

    def cancel(self) -> bool:
        return self._task.cancel()


class InlineLookupClient:
    """Lookups for an engine thread that waits on them itself, as vLLM's scheduler does:
    the client's event loop runs in the calling thread, and only while a call waits. A
    lookup then costs the engine no hop to another thread and back (through
    ``BlockingEngineClient``'s, one without any work took 210-280 µs here, as much
    again as the lookup). No heartbeats: a registration the sidecar reaped while the
    engine sent nothing is made again by the next lookup. Not for a thread that runs an
    event loop of its own (use ``EngineClient`` there)."""

    def __init__(self, endpoint: str, **connect_kwargs: Any) -> None:
        """Connect like ``EngineClient.connect`` (a lookup-only registration)."""
        self._loop = asyncio.new_event_loop()
        try:
            self._client: EngineClient = _run_inline(self._loop, lambda: EngineClient.connect(
                endpoint, kv_caches={}, lookup_only=True, **connect_kwargs))
        except BaseException:
            self._loop.close()
            raise

    @property
    def registered(self) -> Registered | None:
        return self._client.registered

    def lookup(self, token_ids: Sequence[int], **kwargs: Any) -> int:
        hit: int = _run_inline(self._loop, lambda: self._client.lookup(token_ids, **kwargs))
        return hit

    def start_lookup(self, token_ids: Sequence[int], **kwargs: Any) -> PendingLookup:
        """``lookup``, sent at the first ``result`` and answered within any later one."""
        return PendingLookup(self._loop, self._loop.create_task(
            self._client.lookup(token_ids, **kwargs)))

    def close(self) -> None:
        """Unregister and disconnect, lookups still pending cancelled; idempotent."""
        if self._loop.is_closed():
            return
        try:
            _run_inline(self._loop, self._aclose)
        finally:
            self._loop.close()

    async def _aclose(self) -> None:
        pending = asyncio.all_tasks() - {asyncio.current_task()}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._client.aclose()

    def __enter__(self) -> InlineLookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_inline(loop: asyncio.AbstractEventLoop, work: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``loop`` in this thread until ``work()`` is done."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return loop.run_until_complete(work())
    raise TransportError("InlineLookupClient called from a thread that runs an event loop: "
                         "use EngineClient there")
