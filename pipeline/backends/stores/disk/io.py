"""The disk tier's I/O, run on its threads: writing batches of records, reading records
back checked, and scanning a directory's segments for the records they hold."""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Callable, Sequence

import numpy
import torch

from pipeline.backends.stores.disk.records import (
    BLOCK,
    MAGIC,
    Header,
    HeaderProblem,
    encode,
    parse_header,
    value_matches,
)
from pipeline.backends.stores.disk.segments import AlignedBuffers, Segment, TierDirectory, aligned

__all__ = ["DiskRecord", "Found", "Pending", "Scanned", "read_records", "scan", "write_batch"]

RESYNC_CHUNK = 1 << 20
"""Bytes a scan reads at a time while it looks for the next record after a bad one."""


@dataclasses.dataclass(eq=False, slots=True)
class DiskRecord:
    segment: Segment
    offset: int
    span: int
    size: int
    tenant: str
    fingerprint: str
    sequence: int


@dataclasses.dataclass(eq=False, slots=True)
class Pending:
    key: str
    value: torch.Tensor
    """The value's bytes in memory, held (pinned) until ``done`` is called."""
    tenant: str
    fingerprint: str
    span: int
    done: Callable[[bool], None]
    """Told on the event loop whether the value became durable."""
    settled: bool = False
    """Its outcome was told (``done``): never twice."""
    queued: bool = False
    """In the tier's queue (again, if a write of it was lost with its segment)."""
    cancelled: bool = False
    """Its key was removed after it was queued: the record written is not indexed (a
    tombstone written after it stands at the next start)."""

    @property
    def removal(self) -> bool:
        """A tombstone (no value)."""
        return self.value.numel() == 0


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    header: Header
    segment: int
    offset: int


@dataclasses.dataclass
class Scanned:
    """What a scan of a tier's directory found."""

    found: list[Found]
    segments: dict[int, Segment]
    dropped: dict[str, int]
    """Records found bad, by reason."""
    unreadable: dict[int, str]
    """Segment files that could not be opened or read (left in place), and why."""


def write_batch(segment: Segment, offset: int, batch: Sequence[Pending],
                sequences: Sequence[int], buffer: numpy.ndarray, secret: bytes,
                failing: bool) -> list[int]:
    """Encode the batch's records back to back into ``buffer`` and write them at
    ``offset``, durably; each record's span. Runs in a writer thread."""
    spans = []
    at = 0
    for item, sequence in zip(batch, sequences, strict=True):
        span = encode(buffer[at:], item.key, item.tenant, item.fingerprint,
                      item.value.numpy(), sequence, secret)
        spans.append(span)
        at += span
    if failing:
        raise OSError(errno.EIO, "injected I/O error at disk.write")
    segment.write(memoryview(buffer.data)[:at], offset)
    return spans


def read_records(wanted: Sequence[tuple[str, DiskRecord, torch.Tensor]],
                 buffers: AlignedBuffers, secret: bytes, failing: bool) -> list[str | None]:
    """Read, check and copy out each record; None or why it failed. Runs in a reader
    thread; raises ``OSError`` when the file system fails."""
    if failing:
        raise OSError(errno.EIO, "injected I/O error at disk.read")
    problems: list[str | None] = []
    for key, record, destination in wanted:
        buffer = numpy.frombuffer(buffers.get(record.span), dtype=numpy.uint8)
        view = memoryview(buffer.data)[: record.span]
        if record.segment.read(view, record.offset) < record.span:
            problems.append("malformed")
            continue
        header = parse_header(view[:BLOCK], secret)
        if isinstance(header, HeaderProblem):
            problems.append(header.reason)
        elif (header.key, header.sequence, header.size, header.tenant, header.fingerprint) != (
                key, record.sequence, record.size, record.tenant, record.fingerprint):
            problems.append("mismatch")
        elif not value_matches(buffer, header):
            problems.append("checksum")
        else:
            destination.numpy()[:] = buffer[header.value_offset :
                                            header.value_offset + header.size]
            problems.append(None)
    return problems


def scan(directory: TierDirectory) -> Scanned:
    """Every record header (tombstones too) in the directory's segments, in order, and
    the segments opened; headers that fail their checks are counted by reason and
    skipped over, and a segment file that cannot be opened or read is left alone. Runs
    in a thread."""
    scanned = Scanned([], {}, {}, {})
    chunk = aligned(RESYNC_CHUNK)
    buffer = numpy.frombuffer(chunk, dtype=numpy.uint8)
    view = memoryview(chunk)
    for number in directory.segment_numbers():
        try:
            segment = directory.open_segment(number)
        except OSError as exc:
            scanned.unreadable[number] = str(exc)
            continue
        try:
            found = _scan_segment(segment, directory.secret, buffer, view, scanned.dropped)
        except OSError as exc:
            segment.close()
            scanned.unreadable[number] = str(exc)
            continue
        scanned.segments[number] = segment
        scanned.found.extend(found)
    return scanned


def _scan_segment(segment: Segment, secret: bytes, buffer: numpy.ndarray, view: memoryview,
                  dropped: dict[str, int]) -> list[Found]:
    found: list[Found] = []
    offset = 0
    while offset + BLOCK <= segment.size:
        if segment.read(view[:BLOCK], offset) < BLOCK:
            break
        header = parse_header(view[:BLOCK], secret)
        if isinstance(header, Header) and offset + header.span <= segment.size:
            found.append(Found(header, segment.number, offset))
            offset += header.span
            continue
        reason = header.reason if isinstance(header, HeaderProblem) else "malformed"
        if reason != "no_record":
            dropped[reason] = dropped.get(reason, 0) + 1
        offset = _next_record(segment, offset + BLOCK, buffer, view)
    return found


def _next_record(segment: Segment, offset: int, buffer: numpy.ndarray,
                 view: memoryview) -> int:
    """The first block at or after ``offset`` that starts with a record's magic (a
    candidate, still to be checked), or the segment's end."""
    magic = numpy.frombuffer(MAGIC, dtype=numpy.uint8)
    while offset < segment.size:
        count = segment.read(view[: min(RESYNC_CHUNK, segment.size - offset)], offset)
        if count < BLOCK:
            break
        starts = buffer[: count // BLOCK * BLOCK].reshape(-1, BLOCK)[:, :4]
        hits = numpy.flatnonzero((starts == magic).all(axis=1))
        if hits.size:
            return offset + int(hits[0]) * BLOCK
        offset += count // BLOCK * BLOCK
    return segment.size


