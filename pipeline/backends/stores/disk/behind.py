"""The embedded store's side of the disk tier: what its memory tier asks of the disk.

Every value the memory tier makes readable is offered to the disk (write-through), its
entry pinned until the write ends; eviction then drops only the memory copy of a value
on disk. A value the disk's queue has no room for waits, unpinned, in ``behind`` (in the
order they came) and is offered again as the queue drains; one evicted from memory
before that is never written, and counted (``skipped``). A lease of a value found only
on disk reads it into an extent of the arena and lends it once it checks out: with
``promote: on_hit`` the extent becomes the value's memory entry, with ``never`` it is
freed when the lease ends.

It runs on the event loop, as the memory tier's index does.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch

from pipeline.backends.stores.disk.tier import DiskRecord, DiskTier, Offer
from pipeline.backends.stores.embedded_index import Entry, Index, index_charge
from pipeline.core.outcomes import LOADED, KeyOutcome, failed
from pipeline.core.runs import value_span
from pipeline.core.store import ValueScope

__all__ = ["DISK", "MEMORY", "DiskBehind", "Lent", "Moved"]

Lent = list[tuple[Entry | None, KeyOutcome]]
MEMORY = "memory"
DISK = "disk"
Moved = Callable[[Sequence[str], str, bool], None]
"""Hears keys that arrived in (True) or left (False) a medium, ``MEMORY`` or ``DISK``."""
FOREIGN = failed("foreign_value: stored on disk for another layout")


class DiskBehind:
    """The disk tier under one memory tier (``index``, whose values ``slot`` gives)."""

    def __init__(self, tier: DiskTier, index: Index, slot: Callable[[Entry], torch.Tensor],
                 *, promote: bool, on_moved: Moved) -> None:
        self.tier = tier
        self._on_moved = on_moved
        self._behind: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        tier.on_room = self._catch_up
        self._index = index
        self._slot = slot
        self._promote = promote

    def presence(self, keys: Sequence[str], stored: list[int | None]) -> list[int | None]:
        """``stored`` (memory's sizes, None where absent) with the disk's sizes filled in."""
        on_disk = self.tier.sizes
        return [size if size is not None else on_disk.get(key)
                for key, size in zip(keys, stored, strict=True)]

    def holds(self, key: str) -> bool:
        return self.tier.enabled and self.tier.has(key)

    def demote(self, entry: Entry, *, force: bool = False) -> None:
        """Write a readable entry's value to disk, behind the caller (pinned meanwhile);
        ``force``: past the queue's bound (a graceful stop's flush)."""
        if self._offer(entry, force=force) == "full":
            self._behind[entry.key] = entry

    def _offer(self, entry: Entry, *, force: bool = False) -> Offer | None:
        """Offer a readable entry to the disk (None: it needs no writing)."""
        if entry.on_disk or entry.removed or self.tier.writing(entry.key):
            return None
        if self.tier.has(entry.key):
            entry.on_disk = True
            return None
        scope = entry.scope
        offered = self.tier.offer(
            entry.key, self._slot(entry), scope.tenant if scope else "",
            scope.fingerprint if scope else "", lambda written: self._written(entry, written),
            force=force)
        if offered == "queued":
            self._index.pin(entry)
        return offered

    def _catch_up(self) -> None:
        """Offer the values the disk is behind on, oldest first, while the queue has room."""
        behind = self._behind
        while behind:
            key, entry = next(iter(behind.items()))
            if self._offer(entry) == "full":
                return
            del behind[key]

    def _written(self, entry: Entry, written: bool) -> None:
        entry.on_disk = written
        self._index.unpin(entry)
        if written:
            self._on_moved([entry.key], DISK, True)

    def lost_copies(self, keys: Sequence[str], *, rewrite: bool) -> None:
        """Keys whose record left the disk: those still in memory are no longer on disk,
        and are written again now (``rewrite``) or at the next stop's flush. (Rewriting
        what the budget evicted would evict more, and write the disk in circles.)"""
        for key in keys:
            entry = self._index.entries.get(key)
            if entry is not None and key in self._index.ready_sizes:
                entry.on_disk = False
                if rewrite:
                    self.demote(entry)

    def not_on_disk(self, keys: Sequence[str]) -> list[str]:
        """Of keys just evicted from memory, those that are gone from the store (a value
        the disk was behind on is counted ``skipped``)."""
        gone = [key for key in keys if not self.holds(key)]
        for key in gone:
            if self._behind.pop(key, None) is not None:
                self.tier.counters.skipped += 1
        return gone

    def record(self, key: str) -> DiskRecord | None:
        return self.tier.record(key) if self.tier.enabled else None

    async def lend(self, wanted: Sequence[tuple[int, DiskRecord]], keys: Sequence[str],
                   size: int, scope: ValueScope | None, lent: Lent) -> None:
        """Read the values of ``wanted`` (a position in ``keys`` and ``lent``, its record)
        into the arena, and lend each that checks out (pinned, ``LOADED``) in ``lent``;
        the others stay as they are there (``MISSING``) or say why not."""
        reads: list[tuple[int, DiskRecord, Entry, bool]] = []
        for position, record in wanted:
            key = keys[position]
            if scope is not None and record.tenant != scope.tenant:
                continue  # another tenant's: a miss, whatever its key says
            if record.size != size:
                lent[position] = (None, failed(f"size_mismatch: stored {record.size}, "
                                               f"want {size}"))
                continue
            if scope is not None and record.fingerprint != scope.fingerprint:
                lent[position] = (None, FOREIGN)
                continue
            room = self._room(key, size, record)
            if room is not None:
                reads.append((position, record, *room))
        if not reads:
            return
        try:
            good = await self.tier.read_into(
                [(keys[position], record, self._slot(entry)) for position, record, entry, _
                 in reads])
        except BaseException:
            good = [False] * len(reads)
            raise
        finally:
            for (_, _, entry, kept), ok in zip(reads, good, strict=True):
                if not ok:
                    if kept:
                        self._index.abandon(entry)
                    else:
                        self._index.unpin(entry)
        for (position, record, entry, kept), ok in zip(reads, good, strict=True):
            if not ok:
                continue
            if kept:
                self._index.make_ready(entry)
                self._on_moved([entry.key], MEMORY, True)
                if self.tier.record(entry.key) is record:
                    entry.on_disk = True
                else:  # its record went while it was read: memory holds the only copy
                    self.demote(entry)
            lent[position] = (entry, LOADED)

    def _room(self, key: str, size: int, record: DiskRecord) -> tuple[Entry, bool] | None:
        """A pinned extent for a value read from disk, and whether it becomes the key's
        memory entry (else it is freed when unpinned); None if memory has no room."""
        span = value_span(size, self._index.align)
        keep = self._promote and key not in self._index.entries
        charge = index_charge(key)
        if keep and not self._index.index_room(charge):
            keep = False
        offset = self._index.make_room(span)
        if offset is None:
            return None
        if keep:
            entry = Entry(key, offset, size, span, charge,
                          scope=ValueScope(record.tenant, record.fingerprint))
            self._index.add(entry)
        else:
            entry = Entry(key, offset, size, span, removed=True)
            self._index.pin(entry)
        return entry, keep

    async def read(self, wanted: Sequence[tuple[int, DiskRecord, torch.Tensor]],
                   keys: Sequence[str]) -> list[bool]:
        """Read each record's value into its buffer, checked; whether each was."""
        return await self.tier.read_into(
            [(keys[position], record, buffer) for position, record, buffer in wanted])

    async def flush(self, entries: Sequence[Entry]) -> None:
        """Write every readable entry not yet on disk, past the queue's bound, within the
        tier's ``flush_timeout_s``; what is not written by then is lost, and logged."""
        self._behind.clear()
        for entry in entries:
            if entry.key in self._index.ready_sizes:
                self._offer(entry, force=True)
        await self.tier.flush(self.tier.flush_timeout_s)
