"""Every blocking Mooncake call: in a worker thread, at most ``max_concurrent_calls`` at
once, bounded by ``call_timeout_s``.

A call that overruns its timeout is abandoned: it raises ``StoreCallAbandoned`` (the
stages withhold its staging slot until it returns, since its thread may still read or
write that memory) and every later call is refused until each abandoned call has
returned. A cancelled caller is released only once its call has returned or timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import structlog

from pipeline.backends.threads import WorkerThreads
from pipeline.core.errors import StoreCallAbandoned, StoreError

__all__ = ["Call", "Calls"]

log = structlog.get_logger("kvsidecar.store.mooncake")

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Call:
    """One call inside the client, as its worker thread and the event loop see it."""

    loop: asyncio.AbstractEventLoop
    """The event loop that made the call (the sidecar runs on asyncio, as pyzmq's
    asyncio sockets require)."""
    returned: bool = False
    abandoned: bool = False
    settled: bool = False
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    def when_returned(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the event loop once the call has returned."""
        if self.settled:
            callback()
        else:
            self.callbacks.append(callback)

    def settle(self) -> None:
        self.settled = True
        for callback in self.callbacks:
            callback()
        self.callbacks.clear()


class Calls:
    """The calls of one Mooncake client."""

    def __init__(self, max_concurrent: int, timeout_s: float, master_address: str) -> None:
        self._limiter = anyio.CapacityLimiter(max_concurrent)
        # Only ever given calls by holders of a _limiter slot, so a call never queues for
        # a thread (a queue would count as call time), and off anyio's shared pool, whose
        # hand-off costs the event loop twice as much (``WorkerThreads``).
        self.threads = WorkerThreads(max_concurrent, name="kvsidecar-mooncake")
        self._timeout_s = timeout_s
        self._master_address = master_address
        self.busy = 0
        """Calls inside the client, abandoned ones included."""
        self._busy_lock = threading.Lock()
        self._abandoned = 0
        """Calls past their timeout that have not returned yet."""
        self._when_returned: list[Callable[[], None]] = []
        self._unusable: str | None = None
        self._closed = False

    def close(self) -> None:
        """Refuse every later call."""
        self._closed = True

    def when_returned(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once no abandoned call is left inside the client (now if
        none is)."""
        if self._abandoned:
            self._when_returned.append(callback)
        else:
            callback()

    async def call(self, op: str, func: Callable[..., T], *args: Any) -> T:
        # Waiting for a slot may be cancelled and does not count against the timeout.
        # A free slot is taken at once: anyio's acquire would first let everything
        # ready on the event loop run, once per store call.
        try:
            self._limiter.acquire_nowait()
        except anyio.WouldBlock:
            await self._limiter.acquire()
        try:
            if self._closed:
                raise StoreError("the mooncake store is closed")
            if self._unusable is not None:
                raise StoreError(self._unusable)
            call = Call(asyncio.get_running_loop())
            with self._busy_lock:
                self.busy += 1  # the worker thread takes it back when func returns
            # Shielded: a cancelled caller must not abandon a thread that may still write
            # into staging memory. The call is bounded by call_timeout_s instead.
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self._timeout_s) as deadline:
                    [result] = await self.threads.submit(
                        [functools.partial(self._run, call, func, *args)])
        finally:
            self._limiter.release()
        if deadline.cancelled_caught:
            self._abandoned += 1
            self._unusable = (
                f"mooncake {op} did not return within {self._timeout_s}s "
                f"(store.mooncake.call_timeout_s); the store refuses calls until it returns: "
                f"check the master at {self._master_address} and the network"
            )
            log.error("store.mooncake.call.timeout", op=op, master=self._master_address)
            with self._busy_lock:
                call.abandoned = True
                returned = call.returned
            if returned:  # between the deadline and now
                self._returned(call)
            raise StoreCallAbandoned(self._unusable, call.when_returned)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    def _run(self, call: Call, func: Callable[..., T], *args: Any) -> T:
        """In a worker thread: the call, then one less call inside the client; if the
        caller gave up on it meanwhile, the event loop hears that it has returned."""
        try:
            return func(*args)
        finally:
            with self._busy_lock:
                self.busy -= 1
                call.returned = True
                abandoned = call.abandoned
            if abandoned:
                # Not waited for: the loop may be shutting down and never run it.
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    call.loop.call_soon_threadsafe(self._returned, call)

    def _returned(self, call: Call) -> None:
        """On the event loop: an abandoned call has returned; once none is left inside
        the client, the store serves again."""
        call.settle()
        self._abandoned -= 1
        if not self._abandoned and self._unusable is not None:
            self._unusable = None
            log.warning("store.mooncake.recovered", master=self._master_address)
        if not self._abandoned:
            callbacks, self._when_returned = self._when_returned, []
            for callback in callbacks:
                callback()
