"""The embedded block store: an LRU cache inside one preallocated byte arena.

The arena is a single uint8 tensor of ``capacity_bytes``, allocated once; values are
extents inside it, each padded to a cache line (``value_span``) so that rows copied
side by side never straddle one. Allocation is best fit over free extents that
coalesce with both neighbours on free. A deployment stores a handful of value sizes
(one per store group), so an evicted block leaves a hole of exactly the size the next
block of its group needs, and holes of different sizes merge as their neighbours go. Unlike a slab
allocator, no memory is ever reserved for a size class that stopped being used, and
evicting every unpinned entry always yields one hole per run between pinned entries,
so the arena cannot fragment into uselessness: a value that fits the capacity left
by in-flight copies is found room by evicting in LRU order.

Keys are counted too: each entry's key and index bookkeeping is charged to an index
budget beside the arena (``index_budget``), and least recently used entries are
evicted when it is spent as when the arena is, so that short values under long keys
cannot grow the index past its share of the store's memory.

The index lives on the event loop thread and is only touched there, so it needs no
lock. Copies run in worker threads (``anyio.to_thread.run_sync`` with a
``CapacityLimiter``) on entries *pinned* for the duration of the copy: a pinned entry
is never evicted, and one removed while pinned keeps its extent until the last pin is
released. Pinning rather than copying under a lock lets reads and writes of different
entries copy in parallel while the loop keeps indexing, and the loop never waits on a
lock that a copy thread holds.

With a disk tier (``disk``) every value made readable is also written to disk behind
the caller, and a value found only there is read back, checked, into the arena before
it is lent (``pipeline.backends.stores.disk.behind``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import anyio.to_thread
import torch
from anyio.abc import AsyncResource

from pipeline.backends.stores.arena import ArenaAllocator
from pipeline.backends.stores.disk.behind import DISK, MEMORY, DiskBehind, Lent, Moved
from pipeline.backends.stores.disk.tier import DiskRecord, DiskTier
from pipeline.backends.stores.embedded_index import (
    Entry,
    Index,
    check_bytes,
    copy_pairs,
    index_budget,
    index_charge,
    lent_runs,
)
from pipeline.core.config import EmbeddedStoreConfig
from pipeline.core.errors import StoreError
from pipeline.core.outcomes import LOADED, MISSING, PRESENT, STORE_FULL, STORED, KeyOutcome, failed
from pipeline.core.runs import VALUE_ALIGN, value_span
from pipeline.core.store import Extents, Presence, ValueScope

__all__ = ["EmbeddedStore", "EmbeddedStoreStats", "Moved", "index_budget", "index_charge"]

DEFAULT_COPY_THREADS = 2

@dataclass(frozen=True, slots=True)
class EmbeddedStoreStats:
    used_bytes: int
    capacity_bytes: int
    keys: int
    evictions: int


class EmbeddedStore(AsyncResource):
    """An in-process ``KVStore``: LRU over a preallocated arena, copies off the event loop.

    Recency is refreshed by ``put`` (also when the key was present) and by a ``get_into``
    that loads it; ``exists`` does not count as a use.
    """

    def __init__(
        self,
        config: EmbeddedStoreConfig,
        *,
        copy_limiter: anyio.CapacityLimiter | None = None,
        on_evicted: Callable[[Sequence[str]], None] = lambda keys: None,
        value_align: int = VALUE_ALIGN,
        disk: DiskTier | None = None,
        promote: bool = True,
        on_moved: Moved = lambda keys, medium, present: None,
    ) -> None:
        """``on_evicted`` hears the keys evicted to make room (on the event loop) that
        are not on disk either; ``on_moved`` every key that arrives in a medium
        (``memory``, ``disk``) or leaves one, but for the values ``put`` or committed,
        which the caller knows of. ``value_align``: each value is padded to a multiple of it
        (1 packs them back to back, the smallest footprint, but rows side by side then
        straddle cache lines). ``disk``: the disk tier under it; ``promote``: a value read
        from disk stays in memory."""
        try:
            # Touched once now: a page's first write costs a fault, several times the
            # copy itself, and the whole budget is held from the start anyway.
            self._arena = torch.zeros(config.capacity_bytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise StoreError(
                f"cannot allocate the embedded store arena of {config.capacity_bytes} bytes "
                f"(store.capacity_bytes): {exc}"
            ) from exc
        self._arena_address = self._arena.data_ptr()
        self._on_evicted = on_evicted
        self._on_moved = on_moved
        self._index = Index(ArenaAllocator(config.capacity_bytes), align=value_align,
                            on_evicted=self._evicted)
        self._disk = (None if disk is None else DiskBehind(
            disk, self._index, self._slot, promote=promote, on_moved=on_moved))
        if disk is not None:
            disk.on_removed = self.disk_removed
        self._limiter = copy_limiter or anyio.CapacityLimiter(DEFAULT_COPY_THREADS)
        self._closed = False

    def _evicted(self, keys: Sequence[str]) -> None:
        self._on_moved(keys, MEMORY, False)
        gone = keys if self._disk is None else self._disk.not_on_disk(keys)
        if gone:
            self._on_evicted(gone)

    def disk_removed(self, keys: Sequence[str], bad: bool) -> None:
        """Keys whose record left the disk (``bad``: found damaged): those not in memory
        either are gone; those in memory are written again when it was damaged, else at
        the next stop."""
        self._on_moved(keys, DISK, False)
        if self._disk is not None:
            self._disk.lost_copies(keys, rewrite=bad)
        gone = [key for key in keys if key not in self._index.ready_sizes]
        if gone:
            self._on_evicted(gone)

    def where(self, key: str) -> str:
        """Where the value under ``key`` is kept (``in memory``, ``on disk``, both), or ''."""
        memory = key in self._index.ready_sizes
        disk = self._disk is not None and self._disk.holds(key)
        return " and ".join(p for p, here in (("in memory", memory), ("on disk", disk)) if here)

    @property
    def memory(self) -> torch.Tensor:
        """The arena every value lives in (for pinning it, say)."""
        return self._arena

    # -- KVStore -----------------------------------------------------------------------

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        """Check the buffer's shape; the embedded store copies with torch, so nothing to pin."""
        self._check_open()
        problem = check_bytes(buffer) or (None if buffer.is_contiguous() else "not contiguous")
        if problem is not None:
            raise ValueError(f"a staging buffer must be a contiguous 1-D uint8 tensor: {problem}")

    async def exists(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Presence]:
        self._check_open()
        if len(keys) != len(sizes):
            raise ValueError(f"exists got {len(keys)} keys and {len(sizes)} sizes")
        stored = list(map(self._index.ready_sizes.get, keys))
        if stored == (sizes if isinstance(sizes, list) else list(sizes)):
            # The usual hit: every block present, in one comparison.
            return [Presence.PRESENT] * len(keys)
        if self._disk is not None and self._disk.tier.enabled:
            stored = self._disk.presence(keys, stored)
        absent, present, foreign = Presence.ABSENT, Presence.PRESENT, Presence.FOREIGN
        return [absent if have is None else present if have == want else foreign
                for have, want in zip(stored, sizes, strict=True)]

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        self._check_open()
        if len(keys) != len(values):
            raise ValueError(f"put got {len(keys)} keys and {len(values)} values")
        outcomes: list[KeyOutcome] = []
        writes: list[tuple[int, Entry, torch.Tensor]] = []
        for key, value in zip(keys, values, strict=True):
            reserved = self._index.reserve(key, value)
            if isinstance(reserved, Entry):
                writes.append((len(outcomes), reserved, value))
                outcomes.append(STORED)
            else:
                outcomes.append(reserved)
        if not writes:
            return outcomes
        pairs = [(value, self._slot(entry)) for _, entry, value in writes]
        try:
            errors = await anyio.to_thread.run_sync(copy_pairs, pairs, limiter=self._limiter)
        except BaseException:
            for _, entry, _ in writes:
                self._index.abandon(entry)
            raise
        for (index, entry, _), error in zip(writes, errors, strict=True):
            if error is None:
                self._ready(entry)
            else:
                self._index.abandon(entry)
                outcomes[index] = failed(error)
        return outcomes

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        self._check_open()
        if len(keys) != len(buffers):
            raise ValueError(f"get_into got {len(keys)} keys and {len(buffers)} buffers")
        outcomes: list[KeyOutcome] = []
        reads: list[tuple[int, Entry, torch.Tensor]] = []
        from_disk: list[tuple[int, DiskRecord, torch.Tensor]] = []
        for key, buffer in zip(keys, buffers, strict=True):
            entry = self._index.readable(key)
            problem = check_bytes(buffer)
            record = None if entry is not None or self._disk is None else self._disk.record(key)
            if record is not None and problem is None and buffer.numel() == record.size:
                from_disk.append((len(outcomes), record, buffer))
                outcomes.append(MISSING)
            elif entry is None:
                outcomes.append(MISSING)
            elif problem is not None:
                outcomes.append(failed(f"bad_buffer: {problem}"))
            elif buffer.numel() != entry.size:
                outcomes.append(
                    failed(f"size_mismatch: stored {entry.size} bytes, buffer {buffer.numel()}")
                )
            else:
                self._index.pin(entry)
                self._index.entries.move_to_end(key)
                reads.append((len(outcomes), entry, buffer))
                outcomes.append(LOADED)
        if reads:
            pairs = [(self._slot(entry), buffer) for _, entry, buffer in reads]
            try:
                errors = await anyio.to_thread.run_sync(copy_pairs, pairs,
                                                        limiter=self._limiter)
            finally:
                for _, entry, _ in reads:
                    self._index.unpin(entry)
            for (index, _, _), error in zip(reads, errors, strict=True):
                if error is not None:
                    outcomes[index] = failed(error)
        if from_disk and self._disk is not None:  # straight into the buffers: no pins
            for (index, _, _), ok in zip(from_disk, await self._disk.read(from_disk, keys),
                                         strict=True):
                if ok:
                    outcomes[index] = LOADED
        return outcomes

    # -- DirectKVStore: stages copy straight into and out of the arena ---------------------

    async def reserve(self, keys: Sequence[str], size: int, *,
                      scope: ValueScope | None = None) -> Extents:
        self._check_open()
        on_disk = self._disk.holds if self._disk is not None else (lambda key: False)
        fresh = len({key for key in keys if key not in self._index.entries
                     and not on_disk(key)})
        span = value_span(size, self._index.align)
        # One extent for the whole batch (evicting as needed), so the caller copies the
        # batch as one matrix; if none can be had, one extent per key.
        run = self._index.make_room(fresh * span) if fresh > 1 else None
        next_offset = run
        lent: list[tuple[Entry | None, KeyOutcome]] = []
        for key in keys:
            if key in self._index.entries:
                self._index.entries.move_to_end(key)
                lent.append((None, PRESENT))
                continue
            if on_disk(key):
                lent.append((None, PRESENT))
                continue
            charge = index_charge(key)
            if not self._index.index_room(charge):
                lent.append((None, STORE_FULL))
                continue
            if next_offset is not None:
                offset: int | None = next_offset
                next_offset += span
            else:
                offset = self._index.make_room(span)
            if offset is None:
                lent.append((None, STORE_FULL))
                continue
            entry = Entry(key, offset, size, span, charge, scope=scope)
            self._index.add(entry)
            lent.append((entry, STORED))
        if run is not None and next_offset is not None and next_offset < run + fresh * span:
            self._index.allocator.free(next_offset, run + fresh * span - next_offset)
        return self._extents(lent)

    def commit(self, extents: Extents, *, written: bool) -> list[KeyOutcome]:
        outcomes = list(extents.outcomes)
        for index, entry in enumerate(extents.handle):
            if entry is None:
                continue
            if written:
                self._ready(entry)
            else:
                self._index.abandon(entry)
                outcomes[index] = failed("not_written")
        extents.handle = []
        return outcomes

    async def lease(self, keys: Sequence[str], size: int, *,
                    scope: ValueScope | None = None) -> Extents:
        self._check_open()
        lent: Lent = []
        from_disk: list[tuple[int, DiskRecord]] = []
        for key in keys:
            entry = self._index.readable(key)
            if entry is None:
                record = None if self._disk is None else self._disk.record(key)
                if record is not None:
                    from_disk.append((len(lent), record))
                lent.append((None, MISSING))
            elif entry.size != size:
                lent.append((None, failed(f"size_mismatch: stored {entry.size}, want {size}")))
            else:
                self._index.pin(entry)
                self._index.entries.move_to_end(key)
                lent.append((entry, LOADED))
        if from_disk and self._disk is not None:
            try:
                await self._disk.lend(from_disk, keys, size, scope, lent)
            except BaseException:
                self.release(self._extents(lent))
                raise
        return self._extents(lent)

    def release(self, extents: Extents) -> None:
        for entry in extents.handle:
            if entry is not None:
                self._index.unpin(entry)
        extents.handle = []

    def _ready(self, entry: Entry) -> None:
        """A reserved entry's value is in: readable, and written to disk behind us."""
        self._index.make_ready(entry)
        if self._disk is not None:
            self._disk.demote(entry)
        self._index.unpin(entry)

    def _extents(self, lent: Lent) -> Extents:
        entries = [entry for entry, _ in lent]
        return Extents(
            runs=lent_runs(entries, self._arena, self._arena_address),
            outcomes=[outcome for _, outcome in lent],
            handle=entries,
        )

    async def remove(self, keys: Sequence[str]) -> int:
        self._check_open()
        removed = 0
        for key in keys:
            entry = self._index.entries.get(key)
            if entry is not None:
                self._index.drop(entry)
                removed += 1
            elif self._disk is not None and self._disk.holds(key):
                removed += 1
        if self._disk is not None:
            self._on_moved(self._disk.tier.remove(keys), DISK, False)
        return removed

    async def aclose(self) -> None:
        """Write what is only in memory to disk (if there is a disk tier, within its
        ``flush_timeout_s``), then forget every entry and release the arena; copies in
        flight keep their slices."""
        if self._closed:
            return
        self._closed = True
        if self._disk is not None:
            await self._disk.flush(list(self._index.entries.values()))
        for entry in self._index.entries.values():
            entry.removed = True
        self._index.entries.clear()
        self._index.ready_sizes.clear()
        self._arena = torch.empty(0, dtype=torch.uint8)

    # -- inspection --------------------------------------------------------------------

    def stats(self) -> EmbeddedStoreStats:
        return EmbeddedStoreStats(
            used_bytes=self._index.allocator.capacity - self._index.allocator.free_bytes,
            capacity_bytes=self._index.allocator.capacity,
            keys=len(self._index.entries),
            evictions=self._index.evictions,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the embedded store is closed")

    def _slot(self, entry: Entry) -> torch.Tensor:
        return self._arena[entry.offset : entry.offset + entry.size]
