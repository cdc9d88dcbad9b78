"""The disk tier: values written behind the embedded store, read back verified.

Writes go through: every value the memory tier takes is offered to the tier. A bounded
queue (``max_queued_bytes``) holds what waits, each value pinned in memory until its
record is written; an offer to a full queue is refused at once, never waited for, and
the caller offers again when ``on_room`` says the queue took a batch. Writers take the
queue in batches of up to ``batch_bytes`` and write each batch with one call at the end
of the open segment, several batches in flight.

A value is *durable* once the write of its batch and the ``fdatasync`` after it
returned: from then on it is in the index, readable, and it survives the process
(SIGKILL included) and a restart.

Space: the budget is a whole number of segments. When a new segment is needed and the
budget is spent, the oldest goes whole, with every record in it. Nothing is moved or
rewritten: a record removed or written again keeps its bytes until its segment goes.

Reads run on threads of their own, never behind writes. A record read back is checked
(header, names, sequence, value checksum) before a byte of it is copied out; one that
fails is dropped from the index and reported, and the caller recomputes it.

An error of the file system on a write or a read (a full disk, EIO, a vanished mount)
disables the tier: it logs ``store.disk.disabled`` once, counts it, answers nothing from
disk from then on, and the memory tier goes on serving.

The index lives on the event loop thread and is only touched there.
"""

from __future__ import annotations

import collections
import errno
import functools
from collections.abc import Callable, Sequence
from typing import Literal

import anyio
import anyio.to_thread
import numpy
import structlog
import torch

from pipeline.backends.stores.disk.index import DiskCounters, DiskIndex
from pipeline.backends.stores.disk.io import (
    DiskRecord,
    Found,
    Pending,
    read_records,
    write_batch,
)
from pipeline.backends.stores.disk.records import record_span
from pipeline.backends.stores.disk.segments import (
    AlignedBuffers,
    Segment,
    TierDirectory,
    aligned,
)
from pipeline.backends.threads import WorkerThreads
from pipeline.core.config import DiskStoreConfig

__all__ = ["DiskCounters", "DiskRecord", "DiskTier"]

log = structlog.get_logger("kvsidecar.store.disk")

WRITER_NICE = 15
"""How much lower the writers' CPU priority is than the sidecar's: below a save's copies
(10). Writing behind memory is the most deferrable work the sidecar has; on a busy host
the disk falls behind (values wait, then are skipped) before saves or loads slow down."""

Offer = Literal["queued", "full", "refused"]
Fault = Callable[[str], bool]
"""Whether the named fault point fires now (tests inject I/O errors through it)."""


class DiskTier:
    """The index of a tier directory's records, its write queue and its I/O."""

    def __init__(self, directory: TierDirectory, config: DiskStoreConfig, *,
                 fault: Fault | None = None,
                 on_removed: Callable[[Sequence[str]], None] = lambda keys: None) -> None:
        """``on_removed`` hears keys whose record left the disk (evicted with its segment,
        dropped as bad, or lost with a disabled tier)."""
        self.path = directory.path
        self._directory = directory
        self._config = config
        self._fault = fault or (lambda name: False)
        self._on_removed = on_removed
        self.on_room: Callable[[], None] = lambda: None
        """Told (on the event loop) when the queue has taken a batch off: room for more."""
        self.enabled = True
        self.index = DiskIndex()
        self.counters = DiskCounters()
        self.segment_bytes = config.segment_bytes
        self.max_segments = max(2, config.bytes // config.segment_bytes)
        self._segments: dict[int, Segment] = {}
        self._open: Segment | None = None
        self._open_end = 0
        self._next_number = 1
        self._sequence = 1
        self._queue: collections.deque[Pending] = collections.deque()
        self._queued_bytes = 0
        self._work = anyio.Event()
        self._idle = anyio.Event()
        self._in_flight = 0
        self._roll_lock = anyio.Lock()
        self._write_limiter = anyio.CapacityLimiter(config.writers)
        self._writers = WorkerThreads(config.writers, name="kvsidecar-disk", nice=WRITER_NICE)
        self._read_limiter = anyio.CapacityLimiter(config.readers)
        self._read_buffers = AlignedBuffers()

    # -- the index ---------------------------------------------------------------------

    @property
    def records(self) -> dict[str, DiskRecord]:
        return self.index.records

    @property
    def sizes(self) -> dict[str, int]:
        """The value size of every record, by key."""
        return self.index.sizes

    def has(self, key: str) -> bool:
        return key in self.index.sizes

    def record(self, key: str) -> DiskRecord | None:
        return self.index.records.get(key)

    @property
    def used_bytes(self) -> int:
        """Bytes the segment files hold on disk (the budget's measure)."""
        return len(self._segments) * self.segment_bytes

    @property
    def budget_bytes(self) -> int:
        return self._config.bytes

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def remove(self, keys: Sequence[str]) -> list[str]:
        """Forget the records under ``keys`` (their bytes stay until their segment
        goes); the keys that had one."""
        return self.index.remove(keys)

    # -- writes ------------------------------------------------------------------------

    def offer(self, key: str, value: torch.Tensor, tenant: str, fingerprint: str,
              done: Callable[[bool], None], *, force: bool = False) -> Offer:
        """Queue ``value`` (uint8, held unchanged until ``done``) to be written under
        ``key``: ``queued``; else, without calling ``done``, ``full`` (pending writes
        fill the queue: offer it again after ``on_room``; ``force`` queues it anyway) or
        ``refused`` (the tier is off, or the record could never fit a batch)."""
        if not self.enabled:
            return "refused"
        span = record_span(key, tenant, fingerprint, value.numel())
        if span is None or span > self._config.batch_bytes:
            self.counters.skipped += 1
            return "refused"
        if not force and self._queued_bytes + span > self._config.max_queued_bytes:
            return "full"
        self._queue.append(Pending(key, value, tenant, fingerprint, span, done))
        self._queued_bytes += span
        self._work.set()
        return "queued"

    @property
    def flush_timeout_s(self) -> float:
        return self._config.flush_timeout_s

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queued value is written, at most ``timeout_s``; whether all
        were (logged if not)."""
        with anyio.move_on_after(timeout_s):
            while self.enabled and (self._queue or self._in_flight):
                self._idle = anyio.Event()
                await self._idle.wait()
            return True
        log.warning("store.disk.flush_unfinished", queued=len(self._queue),
                    queued_bytes=self._queued_bytes, timeout_s=timeout_s,
                    consequence="values not yet written are not kept across the restart")
        return False

    async def _run_writer(self) -> None:
        buffer: numpy.ndarray | None = None
        while True:
            while not self._queue:
                work = self._work
                await work.wait()
                if self._work is work:
                    self._work = anyio.Event()
            batch, span = self._take()
            self.on_room()
            self._in_flight += 1
            try:
                if buffer is None or buffer.size < span:
                    buffer = numpy.frombuffer(aligned(max(span, self._config.batch_bytes)),
                                              dtype=numpy.uint8)
                await self._write(batch, span, buffer)
            finally:
                self._in_flight -= 1
                if not self._queue and not self._in_flight:
                    self._idle.set()

    def _take(self) -> tuple[list[Pending], int]:
        batch: list[Pending] = []
        span = 0
        while self._queue and (not batch or span + self._queue[0].span
                               <= self._config.batch_bytes):
            item = self._queue.popleft()
            batch.append(item)
            span += item.span
        self._queued_bytes -= span
        return batch, span

    async def _write(self, batch: list[Pending], span: int, buffer: numpy.ndarray) -> None:
        if not self.enabled:
            self._settle(batch, None)
            return
        try:
            async with self._roll_lock:
                if self._open is None or self._open_end + span > self._open.size:
                    await self._roll()
                assert self._open is not None
                segment, offset = self._open, self._open_end
                self._open_end += span
            sequences = list(range(self._sequence, self._sequence + len(batch)))
            self._sequence += len(batch)
            failing = self._fault("disk.write")
            segment.readers += 1
            try:
                async with self._write_limiter:
                    (spans,) = await self._writers.run_each([functools.partial(
                        write_batch, segment, offset, batch, sequences, buffer, failing)])
            finally:
                self._release(segment)
        except OSError as exc:
            self._settle(batch, None)
            self._disable("write", exc)
            return
        records = []
        at = offset
        for item, item_span, sequence in zip(batch, spans, sequences, strict=True):
            records.append(DiskRecord(segment, at, item_span, item.value.numel(),
                                      item.tenant, item.fingerprint, sequence))
            at += item_span
        self._settle(batch, None if segment.removed or not self.enabled else records)

    def _settle(self, batch: list[Pending], records: list[DiskRecord] | None) -> None:
        """Index the batch's records (None: it was not written) and tell each value."""
        for index, item in enumerate(batch):
            if records is not None:
                self.index.add(item.key, records[index])
                self.counters.writes += 1
                self.counters.written_bytes += records[index].span
            item.done(records is not None)

    async def _roll(self) -> None:
        """Open a new segment, making room for it (the oldest goes) if the budget is spent."""
        while len(self._segments) >= self.max_segments:
            self._drop_segment(self._segments[min(self._segments)])
        number = self._next_number
        self._next_number += 1
        segment = await anyio.to_thread.run_sync(
            self._directory.create_segment, number, self.segment_bytes)
        self._segments[number] = segment
        self._open, self._open_end = segment, 0

    def _drop_segment(self, segment: Segment) -> None:
        del self._segments[segment.number]
        segment.removed = True
        if self._open is segment:
            self._open = None
        self._directory.remove_segment(segment.number)
        gone = self.index.forget_segment(segment.number)
        self.counters.evicted += len(gone)
        if segment.readers == 0:
            segment.close()
        if gone:
            self._on_removed(gone)

    def _release(self, segment: Segment) -> None:
        segment.readers -= 1
        if segment.removed and segment.readers == 0:
            segment.close()

    # -- reads -------------------------------------------------------------------------

    async def read_into(self, wanted: Sequence[tuple[str, DiskRecord, torch.Tensor]]
                        ) -> list[bool]:
        """Read each record's value into its tensor (uint8, the value's size), checked
        first; whether each was. A record that fails its checks leaves the index."""
        if not wanted or not self.enabled:
            return [False] * len(wanted)
        failing = self._fault("disk.read")
        chunks = [list(wanted[i :: self._config.readers]) for i in
                  range(min(self._config.readers, len(wanted)))]
        results: list[list[str | None]] = [[] for _ in chunks]
        segments = [record.segment for _, record, _ in wanted]
        for segment in segments:
            segment.readers += 1
        error: OSError | None = None

        async def read(index: int) -> None:
            nonlocal error
            try:
                results[index] = await anyio.to_thread.run_sync(
                    read_records, chunks[index], self._read_buffers, failing,
                    limiter=self._read_limiter)
            except OSError as exc:
                error = exc
                results[index] = ["io"] * len(chunks[index])

        try:
            async with anyio.create_task_group() as tg:
                for index in range(len(chunks)):
                    tg.start_soon(read, index)
        finally:
            for segment in segments:
                self._release(segment)
        if error is not None:
            self._disable("read", error)
            return [False] * len(wanted)
        outcomes: list[bool] = [False] * len(wanted)
        for index, chunk_results in enumerate(results):
            for position, problem in enumerate(chunk_results):
                at = index + position * len(chunks)
                key, record, _ = wanted[at]
                if problem is None:
                    outcomes[at] = True
                    self.counters.reads += 1
                    self.counters.read_bytes += record.span
                else:
                    self._drop_bad(key, record, problem)
        return outcomes

    def _drop_bad(self, key: str, record: DiskRecord, reason: str) -> None:
        self.counters.dropped[reason] = self.counters.dropped.get(reason, 0) + 1
        log.warning("store.disk.dropped", key=key, reason=reason,
                    segment=record.segment.number, offset=record.offset)
        if self.index.records.get(key) is record:
            self.index.forget(key)
            self._on_removed([key])

    # -- start and failure -------------------------------------------------------------

    def adopt(self, found: Sequence[Found], segments: dict[int, Segment],
              dropped: dict[str, int]) -> None:
        """Index what a scan of the directory found (the later of two records under one
        key stands) and keep within the budget, oldest segments first."""
        self._segments = dict(sorted(segments.items()))
        for reason, count in dropped.items():
            self.counters.dropped[reason] = self.counters.dropped.get(reason, 0) + count
        for item in found:
            header = item.header
            current = self.index.records.get(header.key)
            if current is not None and current.sequence > header.sequence:
                continue
            self.index.add(header.key, DiskRecord(
                self._segments[item.segment], item.offset, header.span, header.size,
                header.tenant, header.fingerprint, header.sequence))
            self._sequence = max(self._sequence, header.sequence + 1)
        self._next_number = max(self._segments, default=0) + 1
        while len(self._segments) > self.max_segments:
            self._drop_segment(self._segments[min(self._segments)])

    def _disable(self, operation: str, exc: OSError) -> None:
        self.counters.errors += 1
        if not self.enabled:
            return
        self.enabled = False
        reason = errno.errorcode.get(exc.errno or 0, "error")
        log.error("store.disk.disabled", path=str(self.path), operation=operation,
                  reason=reason, error=str(exc),
                  consequence="nothing is read from or written to disk until a restart; "
                              "the memory tier goes on serving")
        lost = self.index.clear()
        queued, self._queue = list(self._queue), collections.deque()
        self._queued_bytes = 0
        self._settle(queued, None)
        self._idle.set()
        if lost:
            self._on_removed(lost)

    def close(self) -> None:
        self._writers.close()
        queued, self._queue = list(self._queue), collections.deque()
        self._queued_bytes = 0
        self._settle(queued, None)
        for segment in self._segments.values():
            if segment.readers == 0:
                segment.close()
        self._directory.close()
