"""Worker threads of their own for one copy direction, optionally at a lower CPU priority.

Saves are background work: what waits on them is only the engine's reuse of a block it
already computed. Loads, and the engines' own forward passes, are on a request's critical
path. On a host whose cores the engines share, a save's copy threads running at a lower
priority (a higher nice value, Linux's per-thread one) give way to those without being
slowed when the cores are free: the kernel weighs runnable threads by nice, it never
parks one while a core is idle.

anyio's worker threads are one pool for every kind of work, so a priority set on one of
them would follow whatever work it ran next, and an unprivileged process cannot raise a
thread's priority back. These threads run only their own direction's work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

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


class WorkerThreads:
    """``threads`` threads, started on first use; ``nice``: how much lower their CPU
    priority is than the sidecar's (0: the same)."""

    def __init__(self, threads: int, *, name: str, nice: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.total = threads
        self.nice = nice
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,))

    async def run(self, work: Callable[..., T], *args: object) -> T:
        """``work(*args)`` in one of the threads. Cancelling the caller waits for it to
        return (the work owns the buffers it was given until then)."""
        future = self._executor.submit(work, *args)
        with anyio.CancelScope(shield=True):
            result = await asyncio.wrap_future(future)
        return result

    def close(self) -> None:
        """Let the threads exit once the work given them is done."""
        self._executor.shutdown(wait=False)
