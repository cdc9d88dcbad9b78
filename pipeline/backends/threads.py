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
from typing import Any, Generic, Literal, TypeVar

import anyio
import structlog

from pipeline.backends import _blockcopy

__all__ = ["CopyKind", "NativeThreads", "WorkerThreads"]

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


CopyKind = Literal["gather", "scatter"]
"""A copy of ``_blockcopy`` that ``NativeThreads`` run."""


class NativeThreads:
    """``threads`` threads of the native copy library's own (``_blockcopy.Pool``),
    started on first use; ``nice`` as ``WorkerThreads``. They run ``_blockcopy``'s copies
    and never take the GIL: not to start one, not to report it run. The last copy of a
    batch run is counted on an eventfd the event loop watches (one wake-up a batch), and
    the loop then sets the batch's future.

    ``WorkerThreads`` running the same copies took the GIL back as each returned, and
    again to report it, each time when the event loop might be letting it go for a
    moment (a socket send, a torch op): the loop then waited for that thread to be
    scheduled, let go and be scheduled again, on a host whose cores were busy."""

    def __init__(self, threads: int, *, name: str, nice: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.total = threads
        self.nice = nice
        self._name = name
        self._pool: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def run(self, kind: CopyKind, calls: Sequence[tuple[Any, ...]]) -> None:
        """``_blockcopy``'s ``kind`` with each of ``calls``' arguments, spread over the
        threads; returns once all have run. Cancelling the caller waits for them all (the
        copies own the buffers they were given until they have run)."""
        if not calls:
            return
        pool = self._started()
        ran: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pool.run(kind == "scatter", ran, list(calls))
        with anyio.CancelScope(shield=True):
            await ran

    def native_ids(self) -> list[int]:
        """Each thread's id, once started (``threading.get_native_id``'s kind)."""
        return [] if self._pool is None else list(self._pool.native_ids())

    def close(self, *, wait: bool = True) -> None:
        """Run what was handed over, then end the threads (``wait`` is accepted for
        ``WorkerThreads``' sake: a copy always returns)."""
        self._closed = True
        if self._pool is None:
            return
        self._unwatch()
        self._pool.close()

    def _started(self) -> Any:
        if self._closed:
            raise RuntimeError(f"{self._name} threads are closed")
        if self._pool is None:
            self._pool = _blockcopy.Pool(self.total, nice=self.nice, name=self._name)
            if self._pool.nice_error:
                log.warning("copy.priority.unchanged", nice=self.nice,
                            error=os.strerror(self._pool.nice_error))
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop (tests run several)
            self._unwatch()
            loop.add_reader(self._pool.fileno(), self._collect)
            self._loop = loop
        return self._pool

    def _unwatch(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._pool.fileno())
        self._loop = None

    def _collect(self) -> None:
        for ran in self._pool.collect():
            if not ran.done():  # cancelled: the loop is closing
                ran.set_result(None)
