"""Worker threads of their own for one kind of work (a copy direction, a store's calls),
optionally at a lower CPU priority.

Saves are background work: what waits on them is only the engine's reuse of a block it
already computed. Loads, and the engines' own forward passes, are on a request's critical
path. On a host whose cores the engines share, a save's copy threads running at a lower
priority (a higher nice value, Linux's per-thread one) give way to those without being
slowed when the cores are free: the kernel weighs runnable threads by nice, it never
parks one while a core is idle.

anyio's worker threads are one pool for every kind of work, so a priority set on one of
them would follow whatever work it ran next, and an unprivileged process cannot raise a
thread's priority back. These threads run only their own kind of work.

A batch's parts are handed over together and answered together: the thread that
finishes last wakes the event loop once. A ``concurrent.futures`` pool answers each part
through a future of its own, chained to one of the event loop's, and the caller awaits
them in tasks of their own: some 50 µs of the event loop's time per part, measured, on
the path of every save and load.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import anyio
import structlog

__all__ = ["WorkerThreads"]

log = structlog.get_logger("kvsidecar.copy")

T = TypeVar("T")


def _lower_priority(nice: int) -> None:
    """This thread's nice value raised by ``nice`` (Linux: nice is per thread)."""
    if nice and sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError as exc:  # a sandbox may forbid it: run at the usual priority
            log.warning("copy.priority.unchanged", nice=nice, error=str(exc))


class _Batch(Generic[T]):
    """Calls handed to the threads together; their results reach the event loop at
    once, when the last call returns (the first error instead, if any raised)."""

    def __init__(self, count: int, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[list[T]] = loop.create_future()
        self._loop = loop
        self._left = count
        self._results: list[Any] = [None] * count
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def returned(self, index: int, result: T | None, error: BaseException | None) -> None:
        """Call ``index`` returned ``result`` or raised ``error`` (in a worker thread)."""
        with self._lock:
            self._results[index] = result
            self._error = self._error or error
            self._left -= 1
            if self._left:
                return
        try:
            self._loop.call_soon_threadsafe(self._settle)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass

    def _settle(self) -> None:
        if self.future.done():  # cancelled: the caller stopped waiting, or the loop ended
            return
        if self._error is not None:
            self.future.set_exception(self._error)
        else:
            self.future.set_result(self._results)


class WorkerThreads:
    """``threads`` threads, started on first use; ``nice``: how much lower their CPU
    priority is than the sidecar's (0: the same)."""

    def __init__(self, threads: int, *, name: str, nice: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.total = threads
        self.nice = nice
        self._name = name
        self._calls: queue.SimpleQueue[tuple[_Batch[Any], int, Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._threads: list[threading.Thread] = []
        self._closed = False

    async def run_each(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        """Every call, each in one of the threads (at most ``total`` at a time): their
        results, once all have returned. An error any call raised is raised here, once
        all have returned. Cancelling the caller waits for them all (the calls own the
        buffers they were given until they return)."""
        future = self.submit(calls)
        with anyio.CancelScope(shield=True):
            results = await future
        return results

    def submit(self, calls: Sequence[Callable[[], T]]) -> asyncio.Future[list[T]]:
        """Hand the calls to the threads: the event loop's future of what ``run_each``
        returns. Cancelling it stops no call; it only stops the wait. Refused once the
        threads are closed (no thread would take the calls: the wait would never end)."""
        if self._closed:
            raise RuntimeError(f"{self._name} threads are closed")
        if not self._threads:
            self._start()
        batch: _Batch[T] = _Batch(len(calls), asyncio.get_running_loop())
        for index, call in enumerate(calls):
            self._calls.put((batch, index, call))
        if not calls:  # no thread will answer
            batch.future.set_result([])
        return batch.future

    def close(self, *, wait: bool = True) -> None:
        """Let the threads exit once the work given them is done, and (``wait``) wait
        for that. A thread still on its way out as the interpreter finalizes is killed
        where it stands, and a C++ library's thread state with it: the process aborts.
        Not waiting is for work that may never return (an abandoned store call)."""
        self._closed = True
        for _ in self._threads:
            self._calls.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _start(self) -> None:
        # Daemons: a process that ends without close() does not wait on idle threads.
        self._threads = [
            threading.Thread(target=self._serve, name=f"{self._name}_{index}", daemon=True)
            for index in range(self.total)
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self) -> None:
        _lower_priority(self.nice)
        while (item := self._calls.get()) is not None:
            _call(*item)
            # Nothing of a call may outlive it while the thread waits for the next: its
            # arguments can hold an engine's mapped memory, which is unmapped only once
            # nothing refers to it any more.
            del item


def _call(batch: _Batch[T], index: int, call: Callable[[], T]) -> None:
    try:
        result = call()
    except BaseException as exc:  # handed to the caller, raised there
        batch.returned(index, None, exc)
    else:
        batch.returned(index, result, None)
