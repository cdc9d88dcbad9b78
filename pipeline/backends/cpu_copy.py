"""The CPU copy engine: engine KV blocks to and from stored values, in worker threads.

Saves gather engine blocks into the values and seal each value's checksum; loads verify
each value, then scatter the intact ones into engine blocks, so an engine never receives
a corrupted byte. A small batch is copied on the event loop (quicker than a hand-off to
a thread), a larger one by one worker thread, and a large one is shared by the
direction's threads value by value, each value copied and checksummed by whichever
thread claims it first (``CopyThreads``).

A run of adjacent values is one call into ``_blockcopy`` (``native/blockcopy.c``), which
copies every page and hashes it without the GIL, in the copy's own pass: a checksum
costs no second pass over memory. A loaded value is hashed whole before any of it is
copied, then copied from cache. Into memory no cache holds (the root says where: the
embedded store's values, the engine blocks a large load lands in), both write around
the caches (streaming stores). The measurements behind each bound below are on the
benchmarks page."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy

from pipeline.backends import _blockcopy
from pipeline.backends.threads import WorkerThreads
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.runs import Run

__all__ = [
    "Copy",
    "CopyThreads",
    "CpuCopyEngine",
    "copy_features",
    "gather_and_seal",
    "page_addresses",
    "page_table",
    "verify_and_scatter",
]

SPLIT_BYTES = 8 << 20
"""Batches smaller than this are copied by one thread: a split costs a thread hand-off
per thread, which a small copy does not earn back."""
INLINE_BYTES = 512 << 10
"""Saved batches up to this size are copied on the event loop: the copy takes less time
than the hand-off to a worker thread would."""
LOAD_INLINE_BYTES = 4 << 20
"""Loaded batches up to this size are copied on the event loop, which holds it for well
under a millisecond: an engine waits on a load, and a hand-off to a worker thread is two
wake-ups, each of which waits for a free core when the cores are busy, while the loop is
already running."""
LOAD_STREAM_BYTES = 4 << 20
"""Loaded batches of at least this size are written around the caches. A load lands in
blocks the engine took from its free queue, least recently used first, which no cache
holds; a small one may land in blocks the engine has just written, whose lines a cache
still holds, where streaming stores cost more than they save."""
Copy = Callable[["numpy.ndarray | None", int], int]
"""Copies a batch's values, in whatever thread calls it, and says how many it copied;
given ``progress`` (int64 ``[runs, 2]``), each of the batch's runs is shared with the
other callers given the same, value by value, and the call copies at most ``limit``
values (0: no limit) (``_blockcopy``). Its native arguments are worked out once, as it
is made: a shared copy is called again after each slice, and torch's and numpy's small
calls cost tens of microseconds each on a sidecar's event loop just after a copy has
passed through the caches."""


class CopyThreads:
    """Runs one batch's copy: small ones inline, others in one worker thread, a large
    one shared by the direction's threads value by value.

    Torch runs single-threaded in the sidecar (``pipeline.app.process``): an OpenMP team
    per call would cost a wake-up per segment. Each thread checksums exactly the values
    it copied (no barrier between the copy and the checksums), and each direction has
    threads of its own (``WorkerThreads``). Shared value by value, the values a thread
    has not claimed while it is preempted go to the others, so no thread waits at the
    batch's end for a slower half.
    """

    def __init__(
        self, threads: WorkerThreads, split_bytes: int = SPLIT_BYTES,
        inline_bytes: int = INLINE_BYTES,
    ) -> None:
        self._threads = threads
        self._split_bytes = split_bytes
        self._inline_bytes = inline_bytes

    def waits(self, nbytes: int) -> bool:
        """Whether a batch of ``nbytes`` goes to the threads, not done on the event loop."""
        return nbytes > self._inline_bytes

    async def run(self, copy: Copy, runs: int, count: int, size: int) -> None:
        """``copy`` of a batch of ``runs`` runs, ``count`` values of ``size`` bytes."""
        nbytes = count * size
        if not self.waits(nbytes):
            copy(None, 0)
            return
        threads = min(self._threads.total, count) if nbytes >= self._split_bytes else 1
        if threads == 1:
            await self._threads.run_each([functools.partial(copy, None, 0)])
        else:
            progress = numpy.zeros((runs, 2), dtype=numpy.int64)
            await self._threads.run_each([functools.partial(copy, progress, 0)] * threads)


def copy_features() -> dict[str, int | bool]:
    """How this CPU's copies run, for the start-up line: the bytes each streaming store
    writes (0: none), and whether a save seals each value in the copy's own pass (AVX2;
    else each chunk is copied, then hashed)."""
    return {"streaming_store_bytes": _blockcopy.stream_width(),
            "seal_in_copy_pass": _blockcopy.fused_seal()}


def page_table(geometry: StoreGroupGeometry, block_ids: Sequence[int]) -> memoryview:
    """Where block ``block_ids[i]``'s page in segment ``j`` lies: int64 ``[blocks,
    segments]`` as bytes, the native copies' ``pages`` (``_pages`` picks a run's). Worked
    out natively: numpy's few small calls cost tens of microseconds a request in a busy
    sidecar. Refused (IndexError) unless every id names a block of every segment: the
    native copies address pages without bounds of their own."""
    return memoryview(
        _blockcopy.page_table(block_ids, geometry.segment_table, geometry.num_blocks))


def page_addresses(geometry: StoreGroupGeometry, block_ids: Sequence[int]) -> numpy.ndarray:
    """``page_table`` as a numpy array, for the calls that pick rows of it."""
    return numpy.frombuffer(page_table(geometry, block_ids), dtype=numpy.int64).reshape(
        len(block_ids), len(geometry.page_sizes))


def _pages(geometry: StoreGroupGeometry, pages: memoryview, start: int, count: int
           ) -> memoryview:
    """Rows ``start`` to ``start + count`` of a ``page_table``."""
    width = 8 * len(geometry.page_sizes)
    return pages[start * width : (start + count) * width]


def _gather_and_seal(geometry: StoreGroupGeometry, pages: memoryview, stream: bool,
                     runs: Sequence[Run]) -> Copy:
    offsets, sizes = geometry.segment_table[2:]
    seed = geometry.checksum_seed
    return functools.partial(_each_run, [
        functools.partial(_blockcopy.gather, _pages(geometry, pages, run.first, run.count),
                          run.address, run.stride, offsets, sizes, seed is not None,
                          seed or 0, geometry.value_bytes, stream)
        for run in runs])


def _verify_and_scatter(geometry: StoreGroupGeometry, pages: memoryview, stream: bool,
                        intact: memoryview, runs: Sequence[Run]) -> Copy:
    offsets, sizes = geometry.segment_table[2:]
    seed = geometry.checksum_seed
    return functools.partial(_each_run, [
        functools.partial(_blockcopy.scatter, _pages(geometry, pages, run.first, run.count),
                          run.address, run.stride, offsets, sizes, seed is not None,
                          seed or 0, geometry.value_bytes,
                          intact[run.first : run.first + run.count], stream)
        for run in runs])


def _each_run(copies: Sequence[Callable[[Any, int], int]], progress: numpy.ndarray | None,
              limit: int) -> int:
    """Each run's ``copy(shared, most)`` in turn (``shared``: its row of ``progress``, or
    None; ``most``: the values it may copy, 0: any), at most ``limit`` values in all
    (0: no limit): the values copied."""
    copied = 0
    for index, copy in enumerate(copies):
        if limit and copied == limit:
            break
        copied += copy(None if progress is None else progress[index], limit and limit - copied)
    return copied


async def gather_and_seal(
    copy: CopyThreads, geometry: StoreGroupGeometry, block_ids: Sequence[int],
    runs: Sequence[Run], *, stream: bool = False,
) -> None:
    """Fill each value (of ``runs``, one per block) from its engine block, sealing its
    checksum as its pages pass; ``stream``: write the values around the caches."""
    pages = page_table(geometry, block_ids)
    await copy.run(_gather_and_seal(geometry, pages, stream, runs), len(runs),
                   len(block_ids), geometry.stored_bytes)


async def verify_and_scatter(
    copy: CopyThreads, geometry: StoreGroupGeometry, block_ids: Sequence[int],
    runs: Sequence[Run], *, stream: bool = False,
) -> list[bool]:
    """Check each value against its sealed checksum, then copy only the intact ones into
    their engine blocks: the engine never receives a corrupted byte. Whether each is intact.
    ``stream``: write the engine's pages around the caches.
    """
    pages = page_table(geometry, block_ids)
    intact = bytearray(len(block_ids))
    await copy.run(_verify_and_scatter(geometry, pages, stream, memoryview(intact), runs),
                   len(runs), len(block_ids), geometry.stored_bytes)
    return list(map(bool, intact))


def still_as_copied(geometry: StoreGroupGeometry, block_ids: Sequence[int],
                    runs: Sequence[Run]) -> list[bool]:
    """Whether each engine block still holds, in its first and last pages, what its
    value (of ``runs``, one per block) was copied from: those pages hashed again where
    they lie, against the same pages of the value. A block the engine wrote during the
    copy over a part already copied (a forward writes every page) differs; the sample
    costs a small part of a full second pass, which cost as much as the copy itself."""
    if not block_ids:
        return []
    segments = sorted({0, len(geometry.page_sizes) - 1})
    offsets, sizes = geometry.segment_table[2][segments], geometry.segment_table[3][segments]
    pages = numpy.ascontiguousarray(page_addresses(geometry, block_ids)[:, segments])
    rows = numpy.empty(len(block_ids), dtype=numpy.int64)
    for run in runs:
        rows[run.first : run.first + run.count] = (
            run.address + run.stride * numpy.arange(run.count, dtype=numpy.int64))
    copied = numpy.ascontiguousarray(rows[:, None] + offsets[None, :])
    now = numpy.empty(len(block_ids), dtype=numpy.uint64)
    then = numpy.empty(len(block_ids), dtype=numpy.uint64)
    # Here, not in a worker thread: a hop there costs more than these few pages.
    _blockcopy.digests(pages, sizes, 0, now)
    _blockcopy.digests(copied, sizes, 0, then)
    return [bool(same) for same in now == then]


class CpuCopyEngine:
    """The copy engine of CPU memory: native copies in worker threads (``CopyThreads``);
    ``inline_bytes``: batches up to this size are copied on the event loop instead.
    ``stream_bytes``: batches of at least this size are written around the caches
    (streaming stores), for memory the caches are unlikely to hold, such as the embedded
    store's values (None: none is).
    """

    def __init__(self, threads: WorkerThreads, *, inline_bytes: int = INLINE_BYTES,
                 stream_bytes: int | None = None) -> None:
        self._copy = CopyThreads(threads, inline_bytes=inline_bytes)
        self._stream_bytes = stream_bytes

    def waits(self, nbytes: int) -> bool:
        return self._copy.waits(nbytes)

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     runs: Sequence[Run]) -> None:
        await gather_and_seal(self._copy, geometry, block_ids, runs,
                              stream=self._streams(geometry, block_ids))

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      runs: Sequence[Run]) -> list[bool]:
        return await verify_and_scatter(self._copy, geometry, block_ids, runs,
                                        stream=self._streams(geometry, block_ids))

    async def unchanged(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                        runs: Sequence[Run]) -> list[bool]:
        return still_as_copied(geometry, block_ids, runs)

    def _streams(self, geometry: StoreGroupGeometry, block_ids: Sequence[int]) -> bool:
        return (self._stream_bytes is not None
                and len(block_ids) * geometry.stored_bytes >= self._stream_bytes)
