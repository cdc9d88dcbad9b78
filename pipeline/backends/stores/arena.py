"""The embedded store's allocator: best-fit byte extents in one arena (see
``embedded_store`` for why best fit over coalescing holes cannot fragment)."""

from __future__ import annotations

import bisect

__all__ = ["ArenaAllocator"]


class ArenaAllocator:
    """Best-fit allocation of byte extents in ``[0, capacity)``, coalescing on free.

    Free extents are indexed by start and by end (to merge with both neighbours in
    O(1)) and by size (a sorted list of the distinct hole sizes, for best fit).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_bytes = 0
        self._size_at_start: dict[int, int] = {}
        self._start_at_end: dict[int, int] = {}
        self._starts_of_size: dict[int, set[int]] = {}
        self._sizes: list[int] = []
        self.free(0, capacity)

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes and return their offset, or ``None`` if no hole fits."""
        index = bisect.bisect_left(self._sizes, size)
        if index == len(self._sizes):
            return None
        hole_size = self._sizes[index]
        start = next(iter(self._starts_of_size[hole_size]))
        self._unlink(start, hole_size)
        if hole_size > size:
            self._link(start + size, hole_size - size)
        self.free_bytes -= size
        return start

    def free(self, start: int, size: int) -> None:
        """Return an extent obtained from ``allocate``; it merges with free neighbours."""
        self.free_bytes += size
        end = start + size
        before = self._start_at_end.get(start)
        if before is not None:
            before_size = self._size_at_start[before]
            self._unlink(before, before_size)
            start, size = before, size + before_size
        after_size = self._size_at_start.get(end)
        if after_size is not None:
            self._unlink(end, after_size)
            size += after_size
        if size:
            self._link(start, size)

    @property
    def holes(self) -> int:
        return len(self._size_at_start)

    def _link(self, start: int, size: int) -> None:
        self._size_at_start[start] = size
        self._start_at_end[start + size] = start
        starts = self._starts_of_size.get(size)
        if starts is None:
            starts = self._starts_of_size[size] = set()
            bisect.insort(self._sizes, size)
        starts.add(start)

    def _unlink(self, start: int, size: int) -> None:
        del self._size_at_start[start]
        del self._start_at_end[start + size]
        starts = self._starts_of_size[size]
        starts.remove(start)
        if not starts:
            del self._starts_of_size[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]
