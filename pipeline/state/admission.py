"""Admission: which request is dispatched when, and whether a save is taken at all.

One policy decides, from what the receive loop tells it, and from nothing else:

- **Order.** A load or a lookup is dispatched as it is read. A save read while other
  frames wait at the socket is held, and so is every message read after it while any
  is held, in order, so that the loads and lookups behind a burst of saves go first.
  Held messages go once no frame waits, or, past ``MAX_HELD``, the oldest before each
  frame is read: a flood of saves still meets the socket's own bound.
- **Saves.** Under ``shed`` overload (``skip``), an engine's save is refused (answered
  at once, every block skipped) past its credits, or when the inbox the save path hands
  saves to has no room (a save taken that later finds an inbox full is shed block by
  block there);
  under ``backpressure`` (``block``) a save waits for room and stops the receive loop
  meanwhile, and credits are unlimited (``-1`` on the wire).

The policy holds only its queue of held messages and the count of refusals to log; it
never reads a socket or a stream, so it is tested on its own.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Admission", "SaveVerdict"]

T = TypeVar("T")
"""What the receive loop holds for a message (the message and its sender)."""


class SaveVerdict(enum.Enum):
    QUEUE = "queue"
    """Taken, and there is room for it now."""
    WAIT = "wait"
    """Taken, and it waits for room (backpressure)."""
    REFUSE = "refuse"
    """Answered at once as overloaded, every block skipped."""


class Admission(Generic[T]):
    """The receive loop's admission policy (see the module)."""

    MAX_HELD = 16
    """Messages held behind saves at most. A save holds its place for as long as frames
    keep arriving: the bound keeps a flood of saves from growing the queue past what
    the socket itself would hold back."""

    def __init__(self, *, shed_saves: bool, save_credits: int) -> None:
        """``shed_saves``: a save that finds no room is refused, not waited for.
        ``save_credits``: saves of one engine in flight at most when shedding."""
        if save_credits < 1:
            raise ValueError(f"save credits must be positive, got {save_credits}")
        self.shed_saves = shed_saves
        self.save_credits = save_credits
        self._held: collections.deque[T] = collections.deque()
        self._refused: collections.Counter[str] = collections.Counter()

    # -- order -------------------------------------------------------------------------

    def goes_now(self, *, is_save: bool, is_load_or_lookup: bool, frames_waiting: bool) -> bool:
        """Whether a message just read is dispatched now (else ``hold`` it)."""
        if is_load_or_lookup:
            return True
        if self._held:
            return False
        return not (is_save and frames_waiting)

    def hold(self, entry: T) -> None:
        self._held.append(entry)

    def next_held(self, *, frames_waiting: bool) -> T | None:
        """The held message to dispatch before reading the next frame, if any."""
        if self._held and (len(self._held) >= self.MAX_HELD or not frames_waiting):
            return self._held.popleft()
        return None

    @property
    def held(self) -> int:
        return len(self._held)

    # -- saves -------------------------------------------------------------------------

    def on_save(self, *, saves_in_flight: int, room: int) -> SaveVerdict:
        """The fate of an engine's save, given its saves in flight and the save path's
        room now."""
        if not self.shed_saves:
            return SaveVerdict.QUEUE if room > 0 else SaveVerdict.WAIT
        if saves_in_flight >= self.save_credits or room <= 0:
            return SaveVerdict.REFUSE
        return SaveVerdict.QUEUE

    def credits(self, *, saves_in_flight: int, room: int) -> int:
        """How many more saves of an engine would be taken now; -1: never refused."""
        if not self.shed_saves:
            return -1
        return max(0, min(self.save_credits - saves_in_flight, room))

    def refused(self, engine_id: str) -> None:
        """Count a refusal, logged in a summary (``refusals``)."""
        self._refused[engine_id] += 1

    def refusals(self) -> Iterator[tuple[str, int]]:
        """Each engine's refusals since the last call, once; then forgotten."""
        counts, self._refused = self._refused, collections.Counter()
        yield from counts.items()
