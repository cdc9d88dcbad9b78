"""The disk tier: values written behind the embedded store, read back verified.

A bounded queue (``max_queued_bytes``) holds the values waiting to be written, each held
unchanged by its caller until told; an offer to a full queue is refused at once, and
the caller offers again when ``on_room`` says there is room. Writers take the queue in
batches of up to ``batch_bytes``, each written with one call at the end of the open
segment, several batches in flight.

A value is *durable* once the write of its batch and the ``fdatasync`` after it
returned: from then on it is in the index, readable, and it survives the process
(SIGKILL included) and a restart.

Space: segments within the budget (``space``). When a new segment is needed and the
budget is spent, the oldest goes whole, with every record in it. Nothing is moved or
rewritten: a record removed or written again keeps its bytes until its segment goes. A
removal is written as a tombstone, so that a restart does not bring the value back.

Reads run on threads of their own, never behind writes. A record read back is checked
(header, names, sequence, value checksum) before a byte of it is copied out; one that
fails is dropped (with a tombstone) and reported, and the caller recomputes it.

An error of the file system (a full disk, EIO, a vanished mount), or any other error of
the tier's own, disables the tier: it logs ``store.disk.disabled`` once, answers nothing
from disk from then on, and the memory tier goes on serving. The index lives on the
event loop thread and is only touched there.
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
    Pending,
    Scanned,
    write_batch,
)
from pipeline.backends.stores.disk.reads import DiskReads
from pipeline.backends.stores.disk.records import record_span
from pipeline.backends.stores.disk.segments import (
    Segment,
    TierDirectory,
    aligned,
)
from pipeline.backends.stores.disk.space import SegmentSpace
from pipeline.backends.threads import WorkerThreads
from pipeline.core.config import DiskStoreConfig

__all__ = ["DiskCounters", "DiskRecord", "DiskTier"]

log = structlog.get_logger("kvsidecar.store.disk")

WRITER_NICE = 15
"""How much lower the writers' CPU priority is than the sidecar's, below a save's copies
(``stages.transfer.save_nice``): writing behind memory is the most deferrable work the
sidecar has, so where cores are contended the disk falls behind (values wait, then are
skipped) first."""

DISABLED = ("nothing is read from or written to disk until a restart; the memory tier "
            "goes on serving")
NO_VALUE = torch.empty(0, dtype=torch.uint8)
"""A tombstone's value."""

Offer = Literal["queued", "full", "refused"]
Fault = Callable[[str], bool]
"""Whether the named fault point fires now (tests inject I/O errors through it)."""


class DiskTier:
    """The index of a tier directory's records, its write queue and its I/O."""

    def __init__(self, directory: TierDirectory, config: DiskStoreConfig, *,
                 fault: Fault | None = None) -> None:
        self.path = directory.path
        self._directory = directory
        self._secret = directory.secret
        self._config = config
        self._fault = fault or (lambda name: False)
        self.on_removed: Callable[[Sequence[str], bool], None] = lambda keys, bad: None
        """Hears keys whose record left the disk, on the event loop, and whether it was
        found bad (else evicted with its segment, or lost with a disabled tier)."""
        self.on_room: Callable[[], None] = lambda: None
        """Told (on the event loop) when the queue has taken a batch off: room for more."""
        self.enabled = True
        self.index = DiskIndex()
        self.counters = DiskCounters()
        self.space = SegmentSpace(directory, config.segment_bytes, config.bytes,
                                  self._dropped_segment)
        self._sequence = 1
        self._queue: collections.deque[Pending] = collections.deque()
        self.queued_bytes = 0
        """Bytes of the records waiting in the queue."""
        self._pending: dict[str, Pending] = {}
        """The value queued or being written under each key (not tombstones)."""
        self._work = anyio.Event()
        self._idle = anyio.Event()
        self._in_flight = 0
        self._write_limiter = anyio.CapacityLimiter(config.writers)
        """Writes in flight (one per writer task); held whole, it stops every write."""
        self._writers = WorkerThreads(config.writers, name="kvsidecar-disk", nice=WRITER_NICE)
        self._reads = DiskReads(config.readers, directory.secret)

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

    def writing(self, key: str) -> bool:
        """Whether a value under ``key`` is queued or being written."""
        return key in self._pending

    @property
    def used_bytes(self) -> int:
        return self.space.used_bytes

    def remove(self, keys: Sequence[str]) -> list[str]:
        """Forget the values under ``keys``, written or on their way, and write a
        tombstone for each, so that none comes back after a restart; the keys that had
        a record."""
        gone = []
        for key in keys:
            pending = self._pending.pop(key, None)
            if pending is not None:
                pending.cancelled = True
            if self.index.forget(key) is not None:
                gone.append(key)
            elif pending is None:
                continue
            self._tombstone(key)
        return gone

    def _tombstone(self, key: str) -> None:
        """Queue a tombstone for ``key``: its earlier records stand no more."""
        span = record_span(key, "", "", 0)
        if self.enabled and span is not None:
            self._enqueue(Pending(key, NO_VALUE, "", "", span, lambda written: None))

    # -- writes ------------------------------------------------------------------------

    def offer(self, key: str, value: torch.Tensor, tenant: str, fingerprint: str,
              done: Callable[[bool], None], *, force: bool = False) -> Offer:
        """Queue ``value`` (uint8, held unchanged until ``done``) to be written under
        ``key``: ``queued``; else, without calling ``done``, ``full`` (pending writes
        fill the queue: offer it again after ``on_room``; ``force`` queues it anyway) or
        ``refused`` (the tier is off, or the record could never fit a batch). An empty
        queue takes any value that fits a batch."""
        if not self.enabled:
            return "refused"
        span = record_span(key, tenant, fingerprint, value.numel())
        if span is None or span > self._config.batch_bytes or not value.numel():
            self.counters.skipped += 1
            return "refused"
        if (not force and self.queued_bytes
                and self.queued_bytes + span > self._config.max_queued_bytes):
            return "full"
        item = Pending(key, value, tenant, fingerprint, span, done)
        self._pending[key] = item
        self._enqueue(item)
        return "queued"

    def _enqueue(self, item: Pending) -> None:
        item.queued = True
        self._queue.append(item)
        self.queued_bytes += item.span
        self._work.set()

    @property
    def flush_timeout_s(self) -> float:
        return self._config.flush_timeout_s

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queued value is written (or, the tier off, let go) and no
        write is in flight, at most ``timeout_s``; whether it came to that (logged if
        not)."""
        with anyio.move_on_after(timeout_s):
            while self._queue or self._in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()
            return True
        log.warning("store.disk.flush_unfinished", queued=len(self._queue),
                    queued_bytes=self.queued_bytes, timeout_s=timeout_s,
                    consequence="values not yet written are not kept across the restart")
        return False

    async def run_writer(self) -> None:
        """Write batches from the queue until cancelled."""
        buffer: numpy.ndarray | None = None
        while True:
            while not self._queue:
                work = self._work
                await work.wait()
                if self._work is work:
                    self._work = anyio.Event()
            batch, span = self._take()
            self._in_flight += 1
            try:
                self.on_room()
                if buffer is None or buffer.size < span:
                    buffer = numpy.frombuffer(aligned(max(span, self._config.batch_bytes)),
                                              dtype=numpy.uint8)
                await self._write(batch, span, buffer)
            except Exception as exc:
                self._disable("write", exc)
            finally:
                self._settle(batch, None)  # whatever is left untold (cancelled, failed)
                self._in_flight -= 1
                if not self._queue and not self._in_flight:
                    self._idle.set()

    def _drain(self) -> list[Pending]:
        """Everything queued, taken out of the queue."""
        queued, self._queue = list(self._queue), collections.deque()
        self.queued_bytes = 0
        for item in queued:
            item.queued = False
        return queued

    def _take(self) -> tuple[list[Pending], int]:
        batch: list[Pending] = []
        span = 0
        while self._queue and (not batch or span + self._queue[0].span
                               <= self._config.batch_bytes):
            item = self._queue.popleft()
            item.queued = False
            batch.append(item)
            span += item.span
        self.queued_bytes -= span
        return batch, span

    async def _write(self, batch: list[Pending], span: int, buffer: numpy.ndarray) -> None:
        if not self.enabled:
            return  # the caller tells the batch it was not written
        try:
            segment, offset = await self.space.place(span)
            sequences = list(range(self._sequence, self._sequence + len(batch)))
            self._sequence += len(batch)
            failing = self._fault("disk.write")
            segment.users += 1
            try:
                async with self._write_limiter:
                    (spans,) = await self._writers.run_each([functools.partial(
                        write_batch, segment, offset, batch, sequences, buffer, self._secret,
                        failing)])
            finally:
                self.space.release(segment)
        except Exception as exc:
            self._disable("write", exc)
            return
        if segment.removed and self.enabled:
            # Another writer's roll dropped the segment under this write: write again.
            for item in batch:
                if not item.cancelled:
                    self._enqueue(item)
            return
        records = []
        at = offset
        for item, item_span, sequence in zip(batch, spans, sequences, strict=True):
            records.append(DiskRecord(segment, at, item_span, item.value.numel(),
                                      item.tenant, item.fingerprint, sequence))
            at += item_span
        self._settle(batch, records if self.enabled else None)

    def _settle(self, batch: list[Pending], records: list[DiskRecord] | None) -> None:
        """Index the batch's records (None: it was not written) and tell each value; a
        value removed meanwhile, or overtaken by a later record, is not indexed."""
        for index, item in enumerate(batch):
            if item.settled or item.queued:
                continue
            item.settled = True
            if self._pending.get(item.key) is item:
                del self._pending[item.key]
            if item.removal:
                continue
            written = records is not None and not item.cancelled
            if records is not None and written:
                record = records[index]
                current = self.index.records.get(item.key)
                if current is None or current.sequence < record.sequence:
                    self.index.add(item.key, record)
                self.counters.writes += 1
                self.counters.written_bytes += record.span
            try:
                item.done(written)
            except Exception as exc:  # a caller's bug: the other values must be told
                log.error("store.disk.done_failed", key=item.key, exc_info=exc)

    def _dropped_segment(self, segment: Segment) -> None:
        gone = self.index.forget_segment(segment.number)
        self.counters.evicted += len(gone)
        if gone:
            self.on_removed(gone, False)

    # -- reads -------------------------------------------------------------------------

    async def read_into(self, wanted: Sequence[tuple[str, DiskRecord, torch.Tensor]]
                        ) -> list[bool]:
        """Read each record's value into its tensor (uint8, the value's size), checked
        first; whether each was. A record that fails its checks leaves the index. Waits
        for the reads it started even when cancelled (they write into the tensors)."""
        if not self.enabled:
            return [False] * len(wanted)
        standing = [self.index.records.get(key) is record and not record.segment.removed
                    for key, record, _ in wanted]
        if not all(standing):  # gone since the caller looked: a miss, never a stale read
            chosen = [item for item, ok in zip(wanted, standing, strict=True) if ok]
            read = iter(await self.read_into(chosen) if chosen else [])
            return [ok and next(read) for ok in standing]
        if not wanted:
            return []
        segments = [record.segment for _, record, _ in wanted]
        for segment in segments:
            segment.users += 1
        try:
            problems = await self._reads.read(wanted, failing=self._fault("disk.read"))
        except Exception as exc:
            self._disable("read", exc)
            return [False] * len(wanted)
        finally:
            for segment in segments:
                self.space.release(segment)
        for (key, record, _), problem in zip(wanted, problems, strict=True):
            if problem is None:
                self.counters.reads += 1
                self.counters.read_bytes += record.span
            else:
                self._drop_bad(key, record, problem)
        return [problem is None for problem in problems]

    def _drop_bad(self, key: str, record: DiskRecord, reason: str) -> None:
        self.counters.dropped[reason] = self.counters.dropped.get(reason, 0) + 1
        log.warning("store.disk.dropped", key=key, reason=reason,
                    segment=record.segment.number, offset=record.offset)
        if self.index.records.get(key) is record:
            self.index.forget(key)
            self._tombstone(key)  # else the next start would index it again
            self.on_removed([key], True)

    # -- start and failure -------------------------------------------------------------

    def adopt(self, scanned: Scanned) -> None:
        """Index what a scan of the directory found (the latest record or tombstone
        under a key stands); the oldest segments go until the budget holds. Called
        before anyone is told of removals (``on_removed``): nobody has heard of these
        keys yet."""
        for reason, count in scanned.dropped.items():
            self.counters.dropped[reason] = self.counters.dropped.get(reason, 0) + count
        self._sequence = self.index.adopt(scanned.found, scanned.segments) + 1
        self.space.adopt(scanned.segments,
                         max([*scanned.segments, *scanned.unreadable], default=0))

    def _disable(self, operation: str, exc: Exception) -> None:
        self.counters.errors += 1
        if not self.enabled:
            return
        self.enabled = False
        reason = (errno.errorcode.get(exc.errno or 0, "error") if isinstance(exc, OSError)
                  else "internal")
        log.error("store.disk.disabled", path=str(self.path), operation=operation,
                  reason=reason, error=repr(exc), consequence=DISABLED,
                  exc_info=None if isinstance(exc, OSError) else exc)
        lost = self.index.clear()
        self._settle(self._drain(), None)
        self._idle.set()
        if lost:
            self.on_removed(lost, False)

    def close(self) -> None:
        self._writers.close()
        self._reads.close()
        self._settle(self._drain(), None)
        self.space.close()
        self._directory.close()
