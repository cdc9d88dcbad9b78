"""The disk tier's books: its index (the record that stands under each key, the bytes
each tenant holds on disk, and which keys each segment holds, to forget them when it
goes) and its counters. They live on the event loop thread and are only touched there."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from pipeline.backends.stores.disk.io import DiskRecord, Found
from pipeline.backends.stores.disk.segments import Segment

__all__ = ["DiskCounters", "DiskIndex"]


@dataclasses.dataclass
class DiskCounters:
    writes: int = 0
    written_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    skipped: int = 0
    """Values never written: gone from memory while the disk was behind, or too large
    for a record."""
    errors: int = 0
    evicted: int = 0
    """Records gone with their segment, to make room."""
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    """Records found bad, by reason (``checksum``, ``version``, ``malformed``,
    ``mismatch``): never loaded."""


class DiskIndex:
    def __init__(self) -> None:
        self.records: dict[str, DiskRecord] = {}
        self.sizes: dict[str, int] = {}
        """The value size of every record, by key: what ``exists`` asks, in C loops."""
        self.tenant_bytes: collections.Counter[str] = collections.Counter()
        """Bytes of the records that stand, by tenant."""
        self._segment_keys: dict[int, list[str]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def add(self, key: str, record: DiskRecord) -> None:
        """``record`` stands under ``key`` from now on."""
        self.forget(key)
        self.records[key] = record
        self.sizes[key] = record.size
        self.tenant_bytes[record.tenant] += record.span
        self._segment_keys.setdefault(record.segment.number, []).append(key)

    def forget(self, key: str) -> DiskRecord | None:
        """Nothing stands under ``key`` any more; what did."""
        record = self.records.pop(key, None)
        if record is not None:
            del self.sizes[key]
            self.tenant_bytes[record.tenant] -= record.span
            if not self.tenant_bytes[record.tenant]:
                del self.tenant_bytes[record.tenant]
        return record

    def forget_segment(self, number: int) -> list[str]:
        """Forget every record that stands in segment ``number``; their keys."""
        gone = [key for key in self._segment_keys.pop(number, [])
                if (record := self.records.get(key)) is not None
                and record.segment.number == number]
        for key in gone:
            self.forget(key)
        return gone

    def clear(self) -> list[str]:
        """Forget every record; their keys."""
        keys = list(self.records)
        self.records.clear()
        self.sizes.clear()
        self.tenant_bytes.clear()
        self._segment_keys.clear()
        return keys

    def adopt(self, found: Sequence[Found], segments: Mapping[int, Segment]) -> int:
        """Index the records a scan found, in the order found: of the records and
        tombstones under one key, the one of the highest sequence stands. The highest
        sequence seen (0 if none)."""
        latest: dict[str, int] = {}
        for item in found:
            header = item.header
            if header.sequence <= latest.get(header.key, 0):
                continue
            latest[header.key] = header.sequence
            if header.removal:
                self.forget(header.key)
                continue
            self.add(header.key, DiskRecord(
                segments[item.segment], item.offset, header.span, header.size,
                header.tenant, header.fingerprint, header.sequence))
        return max(latest.values(), default=0)
