"""Frames in and out of a ZMQ socket for asyncio, the non-blocking call first.

pyzmq's asyncio socket builds a future, and adds then drops its file descriptor's
reader, on every send and receive that waits: several times the cost of the call
itself, on the path of every request. Here a frame that can be sent now, or one that
has already arrived, is sent or taken at once, and only a call that would block waits:
on the socket's file descriptor, watched by one reader for the socket's whole life. An
echo's round trip, both ends waiting so, took 107 µs against 130 through pyzmq's
asyncio calls (medians of 19,000, three alternations). A receive first reads the
socket's events, and tries only if a frame is there: one that finds none raises
``zmq.Again``, which cost a sidecar's event loop some 10 µs a request.

ZMQ's descriptor signals that the socket's events may have changed, not which: a waiter
wakes when ``get(zmq.EVENTS)`` shows its event. Any call on the socket may take in the
change a waiter needed without the descriptor signalling again, so after each call made
while others wait, the events are read once more and whoever they let go is woken.

Asking whether a frame waits (``readable``) reads the events only if the descriptor
has signalled since they were last read, or a call was made on the socket since: a
poll of the descriptor costs a third of reading the events, and a sidecar's event loop
asks after every slice of a copy it shares, when the caches hold nothing of ZMQ's.

A send never overtakes one still waiting, so frames leave in the order they were sent.
One task receives at a time. ``fair``: a receive yields to the event loop even when a
frame was there at once, as a server's receive loop under a flood of frames must, not to
starve the tasks that answer them.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

import anyio.lowlevel
import zmq
import zmq.asyncio

__all__ = ["FastSocket"]

T = TypeVar("T")

# Plain ints: pyzmq's constants are enum flags, and ``events & zmq.POLLIN`` builds an
# enum member each time (0.6 µs against 0.03), several times a request.
_IN, _OUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_LAST, _MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)


class FastSocket:
    """A ZMQ socket's sends and receives for asyncio, the non-blocking way first. The
    socket's own asynchronous calls must not be used alongside (they would take over
    its descriptor's reader)."""

    def __init__(self, socket: zmq.Socket[Any], *, fair: bool = False) -> None:
        self.socket = socket
        self._now: zmq.Socket[bytes] = (
            zmq.Socket.shadow(socket.underlying) if isinstance(socket, zmq.asyncio.Socket)
            else socket)
        self._fair = fair
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[int, deque[asyncio.Future[None]]] = {
            _IN: deque(), _OUT: deque()}
        self._sends_waiting = 0
        self._signals = select.poll()
        self._signals.register(self._now.FD, select.POLLIN)
        self._known: int | None = None
        """The events as last read, while no call has been made on the socket since:
        they stay so until the descriptor signals."""

    async def send_multipart(self, frames: list[bytes]) -> None:
        if not self._sends_waiting:
            try:
                self.send_now(frames)
            except zmq.Again:
                pass
            else:
                return
        self._sends_waiting += 1
        try:
            while True:
                await self._wait(_OUT)
                try:
                    self.send_now(frames)
                except zmq.Again:
                    continue
                return
        finally:
            self._sends_waiting -= 1

    def send_now(self, frames: list[bytes]) -> None:
        """Send at once, or raise ``zmq.Again`` without waiting: for a ROUTER, where a
        wait for one peer that does not read would hold up the sends to every other.
        (A caller that also makes waiting sends must not use it: it would overtake
        them.)"""
        self._known = None  # a send that fails may take in a change too
        # Frame by frame, as send_multipart sends them, without its check of every
        # frame's type and its flags built as enum members: 1.2 µs for a reply's two
        # frames against 3.4. A message is atomic: once its first frame is queued
        # (the one a full queue refuses), so is the rest.
        now = self._now
        for frame in frames[:-1]:
            now.send(frame, _MORE)
        now.send(frames[-1], _LAST)
        self._recheck()

    def readable(self) -> bool:
        """Whether a frame has arrived that no one has taken yet."""
        known = self._known
        if known is None or self._signals.poll(0):
            known = self._events()
        return bool(known & _IN)

    async def recv_multipart(self, spin_s: float = 0.0) -> list[bytes]:
        """The next frames. ``spin_s``: when none is there yet, poll for it this long
        before waiting on the descriptor, holding the event loop (see ``_spin``)."""
        return await self._recv(self._take_all, spin_s)

    async def recv_routed(self) -> tuple[zmq.Frame, list[bytes]]:
        """A ROUTER's next message: its routing-id frame, whose metadata names the
        connection's peer (``Frame.get``), and the message's frames."""
        return await self._recv(self._take_routed, 0.0)

    def _take_all(self) -> list[bytes]:
        return self._now.recv_multipart(zmq.NOBLOCK)

    def _take_routed(self) -> tuple[zmq.Frame, list[bytes]]:
        routing = self._now.recv(zmq.NOBLOCK, copy=False)
        # A message is atomic: once its first part has arrived, so has the rest.
        return routing, self._now.recv_multipart(zmq.NOBLOCK) if routing.more else []

    async def _recv(self, take: Callable[[], T], spin_s: float) -> T:
        waited = False
        while True:
            # The socket's events say whether a frame is there: a receive that finds
            # none raises zmq.Again, several times the cost, once a request when idle.
            if self.readable():
                try:
                    frames = take()
                except zmq.Again:
                    pass
                else:
                    break
                finally:
                    self._known = None
            if spin_s:
                self._spin(spin_s)
                spin_s = 0.0
                continue
            await self._wait(_IN)
            waited = True
        self._recheck()
        if self._fair and not waited:  # a wait has let the others run already
            await anyio.lowlevel.checkpoint()
        return frames

    def _spin(self, seconds: float) -> None:
        """Poll until a frame has arrived or ``seconds`` have passed. A thread that sleeps
        for a reply is woken the slower the longer it slept (a core gone idle): an echo
        whose server worked 100-250 µs took 180-194 µs more than that work, and 48-95
        µs more with the caller polling. For a caller with nothing else to do meanwhile."""
        deadline = time.perf_counter() + seconds
        while not self.readable() and time.perf_counter() < deadline:
            pass

    def close(self) -> None:
        """Stop watching the descriptor (before the socket closes: the event loop must
        not poll a descriptor that is gone, or taken by another file)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._now.FD)
        self._loop = None

    async def _wait(self, event: int) -> None:
        """Until the socket's events show ``event`` (readiness it had before the call
        that failed is not waited on: the descriptor signals only a change)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # the first wait, or a socket passed to another loop
            self.close()
            loop.add_reader(self._now.FD, self._events)
            self._loop = loop
        waiter = loop.create_future()
        self._waiters[event].append(waiter)
        try:
            await waiter
        finally:
            waiters = self._waiters[event]
            if waiter in waiters:  # cancelled before it was woken
                waiters.remove(waiter)

    def _events(self) -> int:
        """The socket's events, and whoever waits for one of them woken: reading them
        takes in the change the descriptor signalled, which it will not signal again."""
        events = self._known = cast(int, self._now.get(zmq.EVENTS))
        self._wake(events)
        return events

    def _recheck(self) -> None:
        if self._waiters[_IN] or self._waiters[_OUT]:
            self._events()

    def _wake(self, events: int) -> None:
        for event, waiters in self._waiters.items():
            if events & event:
                while waiters:
                    waiter = waiters.popleft()
                    if not waiter.done():
                        waiter.set_result(None)
