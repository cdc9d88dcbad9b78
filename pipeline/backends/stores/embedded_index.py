"""The embedded store's index: which key lies where in the arena, in LRU order, and the
pins that keep an entry's extent while a copy uses it.

It lives on the event loop thread and is only touched there, so it needs no lock. Each
entry's key and bookkeeping is charged to an index budget beside the arena
(``index_budget``); least recently used, unpinned entries are evicted when either the
arena or the budget is spent. A pinned entry is never evicted, and one removed while
pinned keeps its extent until the last pin is released.
"""

from __future__ import annotations

import operator
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.backends.stores.arena import ArenaAllocator
from pipeline.core.outcomes import PRESENT, STORE_FULL, KeyOutcome, failed
from pipeline.core.runs import Run, value_span
from pipeline.core.store import ValueScope

__all__ = [
    "Entry",
    "Index",
    "copy_pairs",
    "follows",
    "index_budget",
    "index_charge",
    "lent_runs",
]

ENTRY_OVERHEAD_BYTES = 256
"""An index entry's memory besides its key: the entry, its slots in two dictionaries."""


def index_budget(capacity_bytes: int) -> int:
    """The index's share beside an arena of ``capacity_bytes``: a sixteenth, at least
    16 MiB (far more than keys of honest values take: ~0.5 KiB per value of tens)."""
    return max(capacity_bytes // 16, 16 << 20)


def index_charge(key: str) -> int:
    """What an entry under ``key`` costs the index."""
    return sys.getsizeof(key) + ENTRY_OVERHEAD_BYTES


@dataclass(eq=False, slots=True)
class Entry:
    key: str
    offset: int
    size: int
    span: int
    """The arena bytes it occupies: its size, padded (``value_align``)."""
    charge: int = 0
    """What it costs the index (``index_charge``)."""
    pins: int = 0
    removed: bool = False
    """Out of the index; the extent is freed when the last pin goes."""
    scope: ValueScope | None = None
    """Whose the value is (kept with it on disk)."""
    on_disk: bool = False
    """Its value is durable in the disk tier too: evicting it drops only this copy."""


SPAN: Callable[[Entry], int] = operator.attrgetter("span")
CHARGE: Callable[[Entry], int] = operator.attrgetter("charge")


def check_bytes(tensor: object) -> str | None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        described = (
            f"{tensor.dtype} tensor of shape {tuple(tensor.shape)}"
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        return f"expected a 1-D uint8 tensor, got a {described}"
    if tensor.numel() == 0:
        return "empty"
    return None


def follows(entry: Entry | None, previous: Entry | None) -> bool:
    """Whether ``entry`` starts where ``previous``'s span ends, at the same size."""
    return (entry is not None and previous is not None and entry.size == previous.size
            and entry.offset == previous.offset + previous.span)


def lent_runs(entries: list[Entry | None], arena: torch.Tensor, address: int) -> list[Run]:
    """The entries' bytes in ``arena`` (at ``address``) as runs: entries back to back (a
    batch reserved as one extent) are one run, whatever their number."""
    result = []
    start = 0
    for end in range(1, len(entries) + 1):
        first = entries[start]
        growing = end < len(entries) and follows(entries[end], entries[end - 1])
        if first is not None and growing:
            continue
        if first is not None:
            result.append(Run.lent(start, arena, address, first.offset, end - start,
                                   first.size, first.span))
        start = end
    return result


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[str | None]:
    """Copy each (source, destination) pair; runs in a worker thread."""
    errors: list[str | None] = []
    for source, destination in pairs:
        try:
            destination.copy_(source)
        except RuntimeError as exc:
            errors.append(f"copy_failed: {exc}")
        else:
            errors.append(None)
    return errors


class Index:
    """The entries of an arena of ``allocator.capacity`` bytes."""

    def __init__(self, allocator: ArenaAllocator, *, align: int,
                 on_evicted: Callable[[Sequence[str]], None]) -> None:
        self.allocator = allocator
        self.align = align
        self.on_evicted = on_evicted
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.ready_sizes: dict[str, int] = {}
        """The size of every readable entry, by key (an entry whose value is still being
        copied in is not yet here): what ``exists`` asks, in C loops."""
        self.pinned_bytes = 0
        self.used = 0
        """What the entries cost the index (``index_charge``)."""
        self.budget = index_budget(allocator.capacity)
        self.evictions = 0

    def reserve(self, key: str, value: torch.Tensor) -> Entry | KeyOutcome:
        """Index a pinned, not yet readable entry for ``key``, or say why not."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return PRESENT
        problem = check_bytes(value)
        if problem is not None:
            # An empty value would let the index grow without using arena bytes.
            return failed(f"bad_value: {problem}")
        size = value.numel()
        span = value_span(size, self.align)
        charge = index_charge(key)
        if not self.index_room(charge):
            return STORE_FULL
        offset = self.make_room(span)
        if offset is None:
            return STORE_FULL
        entry = Entry(key, offset, size, span, charge)
        self.add(entry)
        return entry

    def add(self, entry: Entry) -> None:
        """Index a new entry, pinned."""
        self.pin(entry)
        self.entries[entry.key] = entry
        self.used += entry.charge

    def index_room(self, charge: int) -> bool:
        """Make the index able to take an entry costing ``charge``, evicting unpinned
        entries oldest first as needed; False if the pinned ones leave no room."""
        if self.used + charge <= self.budget:
            return True
        evicted = self.drop_oldest(self.used + charge - self.budget, CHARGE)
        if evicted:
            self.evictions += len(evicted)
            self.on_evicted(evicted)
        return self.used + charge <= self.budget

    def drop_oldest(self, short: int, cost: Callable[[Entry], int]) -> list[str]:
        """Drop unpinned entries, oldest first, until their ``cost`` makes up ``short``,
        in one walk of the index; their keys."""
        victims: list[Entry] = []
        for entry in self.entries.values():
            if short <= 0:
                break
            if entry.pins == 0:
                victims.append(entry)
                short -= cost(entry)
        for victim in victims:
            self.drop(victim)
        return [victim.key for victim in victims]

    def make_room(self, size: int) -> int | None:
        """Allocate ``size`` bytes (whole spans), evicting unpinned entries oldest first
        as needed."""
        allocator = self.allocator
        if size > allocator.capacity - self.pinned_bytes:
            return None
        # No hole fits while fewer bytes are free than asked: the oldest entries that
        # make up the difference go in one walk of the index, not one walk and one
        # allocation attempt each (a full store evicts on every save).
        evicted = self.drop_oldest(size - allocator.free_bytes, SPAN)
        while (offset := allocator.allocate(size)) is None:
            oldest = next((entry for entry in self.entries.values() if entry.pins == 0), None)
            if oldest is None:
                break
            self.drop(oldest)
            evicted.append(oldest.key)
        if evicted:
            self.evictions += len(evicted)
            self.on_evicted(evicted)
        return offset

    def pin(self, entry: Entry) -> None:
        if entry.pins == 0:
            self.pinned_bytes += entry.span
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            self.pinned_bytes -= entry.span
            if entry.removed:
                self.allocator.free(entry.offset, entry.span)

    def make_ready(self, entry: Entry) -> None:
        """Its value is in: readable from now on (unless it was removed meanwhile)."""
        if not entry.removed:
            self.ready_sizes[entry.key] = entry.size

    def readable(self, key: str) -> Entry | None:
        """The entry under ``key`` if its value is in."""
        return self.entries[key] if key in self.ready_sizes else None

    def drop(self, entry: Entry) -> None:
        """Take an entry out of the index; its extent is freed once nothing copies it."""
        del self.entries[entry.key]
        self.ready_sizes.pop(entry.key, None)
        self.used -= entry.charge
        entry.removed = True
        if entry.pins == 0:
            self.allocator.free(entry.offset, entry.span)

    def abandon(self, entry: Entry) -> None:
        """Undo a reservation whose value never arrived."""
        if not entry.removed:
            self.drop(entry)
        self.unpin(entry)
