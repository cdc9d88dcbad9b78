"""Frames in and out of an asyncio ZMQ socket without a trip through the event loop when
they can go at once.

pyzmq's asyncio socket builds a future and updates its poll registration on every send
and receive, several times the cost of the call itself: under a flood of requests that
is most of what the receive loop does. A frame that can be sent now, or one that has
already arrived, needs none of it: these try the non-blocking call on a synchronous
shadow of the same socket first, and await the asyncio socket only when it would block
(a full queue, nothing received yet). A send never overtakes one still waiting, so
frames leave in the order they were sent. One task receives at a time. A receive still
yields to the event loop as the asyncio one does: a receive loop under a flood of
frames must not starve the tasks that answer them.

ZMQ signals readiness edge-triggered, and any call on the socket may consume the edge
that a waiting asyncio send or receive needed. So after each call made here the asyncio
socket is asked for its events (``get(zmq.EVENTS)``), which is how pyzmq re-checks and
wakes its waiters; it costs one getsockopt when nothing waits.
"""

from __future__ import annotations

import anyio.lowlevel
import zmq
import zmq.asyncio

__all__ = ["FastSocket"]


class FastSocket:
    """An asyncio ZMQ socket's sends and receives, the non-blocking way first."""

    def __init__(self, socket: zmq.asyncio.Socket) -> None:
        self.socket = socket
        self._now: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._sends_waiting = 0

    async def send_multipart(self, frames: list[bytes]) -> None:
        if not self._sends_waiting:
            try:
                self._now.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                self.socket.get(zmq.EVENTS)
                return
        self._sends_waiting += 1
        try:
            await self.socket.send_multipart(frames)
        finally:
            self._sends_waiting -= 1

    def send_now(self, frames: list[bytes]) -> None:
        """Send at once, or raise ``zmq.Again`` without waiting: for a ROUTER, where a
        wait for one peer that does not read would hold up the sends to every other.
        (Never used beside waiting sends, which it would overtake.)"""
        self._now.send_multipart(frames, zmq.NOBLOCK)
        self.socket.get(zmq.EVENTS)

    async def recv_multipart(self) -> list[bytes]:
        try:
            frames = self._now.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return await self.socket.recv_multipart()
        self.socket.get(zmq.EVENTS)
        await anyio.lowlevel.checkpoint()
        return frames
