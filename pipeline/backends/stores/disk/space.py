"""The disk tier's segment files: which exist, which one records are appended to, and
the budget they keep to. Runs on the event loop; file work goes to threads."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread

from pipeline.backends.stores.disk.segments import Segment, TierDirectory

__all__ = ["SegmentSpace"]


class SegmentSpace:
    """Segments of ``segment_bytes`` within ``budget`` bytes. When a new one is needed
    and the budget is spent, the oldest go whole: ``on_dropped`` hears each, on the
    event loop, before its file is unlinked (so that nothing starts reading it)."""

    def __init__(self, directory: TierDirectory, segment_bytes: int, budget: int,
                 on_dropped: Callable[[Segment], None]) -> None:
        self._directory = directory
        self.segment_bytes = segment_bytes
        self.budget = budget
        self._on_dropped = on_dropped
        self.segments: dict[int, Segment] = {}
        self.used_bytes = 0
        """Bytes the segment files take on disk (the budget's measure)."""
        self._open: Segment | None = None
        self._open_end = 0
        self._next_number = 1
        self._lock = anyio.Lock()

    def adopt(self, segments: dict[int, Segment], highest: int) -> list[Segment]:
        """Take the segments a scan found (numbers up to ``highest`` are taken, readable
        or not); the oldest dropped to keep within the budget, their files unlinked."""
        self.segments = dict(sorted(segments.items()))
        self.used_bytes = sum(segment.size for segment in self.segments.values())
        self._next_number = highest + 1
        dropped = []
        while self.segments and self.used_bytes > self.budget:
            dropped.append(self._drop_oldest())
        for segment in dropped:
            self._directory.remove_segment(segment.number)
            if segment.users == 0:
                segment.close()
        return dropped

    async def place(self, span: int) -> tuple[Segment, int]:
        """Where ``span`` bytes of records go: the open segment and an offset in it,
        reserved; a new segment is opened (making room for it) when it has no room.
        Raises ``OSError`` when a segment cannot be made."""
        async with self._lock:
            if self._open is None or self._open_end + span > self._open.size:
                await self._roll()
            assert self._open is not None
            offset = self._open_end
            self._open_end += span
            return self._open, offset

    async def _roll(self) -> None:
        dropped = []
        while self.segments and self.used_bytes + self.segment_bytes > self.budget:
            dropped.append(self._drop_oldest())
        closing = [segment for segment in dropped if segment.users == 0]
        try:
            if dropped:
                await anyio.to_thread.run_sync(self._unlink, dropped)
        finally:
            for segment in closing:  # freeing a large file's blocks: off the event loop
                await anyio.to_thread.run_sync(segment.close)
        number = self._next_number
        self._next_number += 1
        segment = await anyio.to_thread.run_sync(
            self._directory.create_segment, number, self.segment_bytes)
        self.segments[number] = segment
        self.used_bytes += segment.size
        self._open, self._open_end = segment, 0

    def _drop_oldest(self) -> Segment:
        segment = self.segments.pop(next(iter(self.segments)))  # in order: the oldest
        self.used_bytes -= segment.size
        segment.removed = True
        if self._open is segment:
            self._open = None
        self._on_dropped(segment)
        return segment

    def _unlink(self, dropped: list[Segment]) -> None:
        for segment in dropped:
            self._directory.remove_segment(segment.number)

    def release(self, segment: Segment) -> None:
        """A read or write of ``segment`` ended; a dropped one is closed by the last."""
        segment.users -= 1
        if segment.removed and segment.users == 0:
            segment.close()

    def close(self) -> None:
        """Close every segment; one still in use is closed by its last user."""
        for segment in self.segments.values():
            segment.removed = True
            if segment.users == 0:
                segment.close()
