"""Carrying items through a path: the stages a task runs itself, and the hand-off to the
first stage that waits (``pipeline.runner.graph`` declares the rule)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from pipeline.runner.edges import EdgeSendStream
from pipeline.runner.stages import Sink

__all__ = ["Entrance", "Forward", "OnFull", "Step", "Waits"]

Waits = Callable[[Any], bool]
"""Whether a stage waits for this item (it then goes to the stage's inbox)."""
OnFull = Callable[[Any], Awaitable[None]]
"""Answers an item the sender could not hand to a full inbox (``PathSpec.on_full``)."""


@dataclasses.dataclass(frozen=True)
class Step:
    """A stage as the running graph calls it."""

    run: Callable[[Any], Awaitable[Sequence[Any]]]
    """The stage's outputs for an item (none: dropped)."""
    waits: Waits


class Forward:
    """Carries an item through a path from stage ``start`` on, in the calling task, up to
    the first stage that waits for it; holds its own sending ends of the inboxes it may
    hand items to, closed with it (``EndOfStream`` then cascades on drain)."""

    def __init__(self, steps: Sequence[Step], sends: Sequence[EdgeSendStream[Any]],
                 start: int, sink: Sink | None, on_full: OnFull | None = None) -> None:
        self._steps = steps
        self._sends = sends
        self._start = start
        self._sink = sink
        self._on_full = on_full

    async def send(self, item: Any) -> None:
        await self._through(self._start, item)

    async def _through(self, index: int, item: Any) -> None:
        if index == len(self._steps):
            if self._sink is not None:
                await self._sink(item)
            return
        step = self._steps[index]
        try:
            waits = step.waits(item)
        except Exception:  # a rule's bug: the stage's workers and error policy see it
            waits = True
        if waits:
            send = self._sends[index - self._start]
            if self._on_full is None:
                await send.send(item)
                return
            try:
                send.send_nowait(item)
            except anyio.WouldBlock:
                await self._on_full(item)
            return
        for output in await step.run(item):
            await self._through(index + 1, output)

    def clone(self) -> Forward:
        return Forward(self._steps, [send.clone() for send in self._sends], self._start,
                        self._sink, self._on_full)

    def close(self) -> None:
        for send in self._sends:
            send.close()

    async def __aenter__(self) -> Forward:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class Entrance:
    """Where a path's items go in: ``send`` carries an item through the path in the
    sender's task up to the first stage that waits for it (waiting for room there), once
    the graph runs. ``close`` ends the path's input; it takes effect once no send is in
    flight, so that an item being carried reaches its inbox before the stages downstream
    drain. A send after ``close`` raises ``anyio.ClosedResourceError``."""

    def __init__(self) -> None:
        self._forward: Forward | None = None
        self._started = anyio.Event()
        self._running = 0
        self._closing = False
        self.closed = False

    def _open(self, forward: Forward) -> None:
        self._forward = forward
        self._started.set()
        self._close_if_idle()

    async def send(self, item: Any) -> None:
        if self._closing:
            raise anyio.ClosedResourceError
        self._running += 1
        try:
            if self._forward is None:
                await self._started.wait()
            assert self._forward is not None
            await self._forward.send(item)
        finally:
            self._running -= 1
            self._close_if_idle()

    def close(self) -> None:
        self._closing = True
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if (self._closing and not self._running and not self.closed
                and self._forward is not None):
            self.closed = True
            self._forward.close()
