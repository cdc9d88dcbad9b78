"""The CPU copy engine: engine KV blocks to and from stored values, in worker threads.

Saves gather engine blocks into the values and seal each value's checksum; loads verify
each value, then scatter the intact ones into engine blocks. A large batch is shared by
the worker threads value by value, each value copied by whichever claims it first
(``CopyThreads``): a thread checksums exactly the values it copied, a batch costs one
hand-off per thread, and a small batch none (it is copied on the event loop, quicker
than a hand-off). While the event loop has nothing else to do, its own thread takes
part too, rather than sleep until the threads have woken, copied and woken it in turn.

A run of adjacent values is one call into ``_blockcopy`` (``native/blockcopy.c``), which
copies every page and hashes it without the GIL. Copy threads that called torch once
per segment took the GIL back after each call, and behind a busy event loop each such
return waited for the loop's switch interval; the loop waited for them in turn.
A saved value is hashed as it is read, in the copy's own pass (each 64-byte stripe
written and hashed from registers, on CPUs with AVX2) or chunk by chunk, each chunk
hashed from L2 just after it is copied: a checksum costs no second pass over memory.
A loaded value is hashed whole before any of it is copied, then copied from cache. Into
memory no cache holds (the root says where: the embedded store's values, an engine's
blocks a large load lands in), both write around the caches (streaming stores): a copy
that does not first read in each line it writes costs about a fifth less CPU."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy
import torch

from pipeline.backends import _blockcopy
from pipeline.backends.threads import WorkerThreads
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.integrity import CHECKSUM_BYTES
from pipeline.core.runs import Run

__all__ = [
    "Copy",
    "CopyThreads",
    "CpuCopyEngine",
    "HelperThreads",
    "InPlaceCopyEngine",
    "copy_features",
    "gather_and_seal",
    "page_addresses",
    "page_table",
    "read_in_place",
    "row_digests",
    "seal_in_place",
    "verify_and_scatter",
]

SPLIT_BYTES = 8 << 20
"""Batches smaller than this are copied by one thread: a split costs thread hand-offs
(~0.1 ms each on a small machine) that a small copy does not earn back."""
INLINE_BYTES = 512 << 10
"""Saved batches up to this size are copied on the event loop: the copy takes less time
than the hand-off to a worker thread would."""
LOAD_INLINE_BYTES = 4 << 20
"""Loaded batches up to this size are copied on the event loop, although that holds it
for up to about 0.7 ms. An engine waits on a load, and a hand-off to a worker thread is
two wake-ups, each of which waits for a free core when the cores are busy, while the
loop is already running. Measured in the soak, where the sidecar's threads waited on
the run queue about twice as long as they ran: load p99 under 5x the save capacity fell
from 34-55x to 8-10x the unloaded p50. At 4 loads of 2 or 4 MiB in flight, throughput
stayed the same."""

LOAD_STREAM_BYTES = 4 << 20
"""Loaded batches of at least this size are written around the caches (streaming
stores). A load lands in blocks the engine took from its free queue, least recently
used first, which no cache holds; but a small one may land in blocks the engine has
just written or freed, whose lines a cache still holds, and streaming stores into those
cost half as much again. Measured: an 18 MiB load at 1 in flight gained 11%, 2-4 MiB
loads the same either way, and the soak's 1.75 MiB loads into blocks it zeroes just
before were 30% slower streamed."""

SHARED_SPIN_S = 0.0005
"""How long the event loop's thread, done with its share of a copy (``CopyThreads.run``,
``alone``), or the store's thread, done with its share of a batch's work
(``HelperThreads``), spins for the last values in other threads' hands before it
sleeps until they are done: about two values' copy at 1 MiB. A thread asleep is woken
about 0.14 ms late on a small VM (measured: copy threads started 0.07 and 0.17 ms after a
batch was handed over, and the event loop resumed 0.14 ms after the last of them
returned)."""

SHARED_SLICE_BYTES = 1 << 20
"""The event loop's thread, sharing a copy, asks again after copying this much whether
it is still alone (a request that arrives meanwhile waits at most this long, about
0.2 ms), and hands the rest of its share to a worker thread if not."""

Copy = Callable[["numpy.ndarray | None", int], int]
"""Copies a batch's values, in whatever thread calls it, and says how many it copied;
given ``progress`` (int64 ``[runs, 2]``), each of the batch's runs is shared with the
other callers given the same, value by value, and the call copies at most ``limit``
values (0: no limit) (``_blockcopy``). Its native arguments are worked out once, as it
is made: a shared copy is called again after each slice, and torch's and numpy's small
calls cost tens of microseconds each on a sidecar's event loop just after a copy has
passed through the caches."""


class CopyThreads:
    """Runs one batch's copy: small ones inline, others in worker threads, a large one
    shared by them value by value, and, while the event loop has nothing else to do,
    with its thread too (``_shared``).

    Torch runs single-threaded in the sidecar (see ``service``): an OpenMP team per call
    would cost a wake-up per segment. Each thread checksums exactly the values it copied
    (no barrier between the copy and the checksums), and each direction has threads of
    its own (``WorkerThreads``). Shared value by value, the values a thread has not
    claimed while the event loop or an engine preempts it go to the others: a batch cut
    into halves, one thread each, waited at its end for the slower half (measured: saves
    of 24 x 48 KiB x 16 back to back, 4 in flight, took 1.8 to 2.2 ms each against 2.2
    to 2.7).
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

    async def run(self, copy: Copy, runs: int, count: int, size: int, *,
                  alone: Callable[[], bool] = lambda: False) -> None:
        """``copy`` of a batch of ``runs`` runs, ``count`` values of ``size`` bytes.
        ``alone()``: whether the event loop has nothing else to do; while so, its thread
        shares a batch that is split with the worker threads (``_shared``)."""
        nbytes = count * size
        if not self.waits(nbytes):
            copy(None, 0)
            return
        threads = min(self._threads.total, count) if nbytes >= self._split_bytes else 1
        if threads == 1:
            await self._threads.run_each([functools.partial(copy, None, 0)])
        elif alone():
            await self._shared(copy, runs, count, size, alone)
        else:
            progress = numpy.zeros((runs, 2), dtype=numpy.int64)
            await self._threads.run_each([functools.partial(copy, progress, 0)] * threads)

    async def _shared(self, copy: Copy, run_count: int, count: int, size: int,
                      alone: Callable[[], bool]) -> None:
        """Every value copied by whichever of the event loop's thread and all worker
        threads but one claims it first. The loop starts at once, instead of sleeping
        until two threads have woken, worked and woken it in turn; it sleeps only if the
        values still in the others' hands outlast ``SHARED_SPIN_S``. Once it is no
        longer ``alone()`` (asked after each ``SHARED_SLICE_BYTES``), it hands the rest
        of its share to the last worker thread and serves what came. A thread that
        starts after every value is claimed touches none."""
        progress = numpy.zeros((run_count, 2), dtype=numpy.int64)
        share = functools.partial(copy, progress, 0)
        helpers = [self._threads.submit([share] * (self._threads.total - 1))]
        slice_values = max(1, SHARED_SLICE_BYTES // size)
        try:
            while copy(progress, slice_values):
                if not alone():  # serve what came; a worker thread takes the loop's share
                    helpers.append(self._threads.submit([share]))
                    break
            else:
                if _blockcopy.wait_done(progress, count, SHARED_SPIN_S):
                    for calls in helpers:  # what is left of them copies nothing
                        calls.add_done_callback(_retrieve)
                    return
        except BaseException:
            await _all_returned(helpers)
            raise
        await _all_returned(helpers)
        for calls in helpers:
            calls.result()  # an error a call raised


async def _all_returned(calls: Sequence[asyncio.Future[Any]]) -> None:
    """Until the calls have returned (or raised): they own the buffers they were given
    until then, so a cancelled caller waits too."""
    with anyio.CancelScope(shield=True):
        await asyncio.wait(calls)


def _retrieve(calls: asyncio.Future[Any]) -> None:
    """Mark the calls' error seen: helpers left unawaited, their share done by others,
    may fail only as their caller did, before copying anything."""
    if not calls.cancelled():
        calls.exception()


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
    alone: Callable[[], bool] = lambda: False,
) -> None:
    """Fill each value (of ``runs``, one per block) from its engine block, sealing its
    checksum as its pages pass; ``stream``: write the values around the caches;
    ``alone``: as ``CopyThreads.run``."""
    pages = page_table(geometry, block_ids)
    await copy.run(_gather_and_seal(geometry, pages, stream, runs), len(runs),
                   len(block_ids), geometry.stored_bytes, alone=alone)


async def verify_and_scatter(
    copy: CopyThreads, geometry: StoreGroupGeometry, block_ids: Sequence[int],
    runs: Sequence[Run], *, stream: bool = False,
    alone: Callable[[], bool] = lambda: False,
) -> list[bool]:
    """Check each value against its sealed checksum, then copy only the intact ones into
    their engine blocks: the engine never receives a corrupted byte. Whether each is intact.
    ``stream``: write the engine's pages around the caches; ``alone``: as
    ``CopyThreads.run``.
    """
    pages = page_table(geometry, block_ids)
    intact = bytearray(len(block_ids))
    await copy.run(_verify_and_scatter(geometry, pages, stream, memoryview(intact), runs),
                   len(runs), len(block_ids), geometry.stored_bytes, alone=alone)
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
    store's values (None: none is). ``alone()``: whether the event loop has nothing else
    to do now, so its thread may share a large copy with the worker threads.
    """

    def __init__(self, threads: WorkerThreads, *, inline_bytes: int = INLINE_BYTES,
                 stream_bytes: int | None = None,
                 alone: Callable[[], bool] = lambda: False) -> None:
        self._copy = CopyThreads(threads, inline_bytes=inline_bytes)
        self._stream_bytes = stream_bytes
        self._alone = alone

    def waits(self, nbytes: int) -> bool:
        return self._copy.waits(nbytes)

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     runs: Sequence[Run]) -> None:
        await gather_and_seal(self._copy, geometry, block_ids, runs,
                              stream=self._streams(geometry, block_ids), alone=self._alone)

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      runs: Sequence[Run]) -> list[bool]:
        return await verify_and_scatter(self._copy, geometry, block_ids, runs,
                                        stream=self._streams(geometry, block_ids),
                                        alone=self._alone)

    async def unchanged(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                        runs: Sequence[Run]) -> list[bool]:
        return still_as_copied(geometry, block_ids, runs)

    def _streams(self, geometry: StoreGroupGeometry, block_ids: Sequence[int]) -> bool:
        return (self._stream_bytes is not None
                and len(block_ids) * geometry.stored_bytes >= self._stream_bytes)


class HelperThreads:
    """Threads that take part in a large batch's work in the store's thread, for values
    moved in place: their checksums (``seal_in_place``) and the copies of values the
    store holds in this process's memory (``read_in_place``), from ``share_bytes`` on.
    Each value goes to whichever thread claims it first (``_blockcopy``'s shared runs):
    the store's thread starts at once and never waits for a helper to wake, and a helper
    that has not started by the time every value is claimed is called off. Measured at 1
    request of 24 x 48 KiB x 16 in flight, where the other core is idle meanwhile: 18 MiB
    were digested in 1.4 ms by two threads against 2.1 ms by one."""

    def __init__(self, threads: int, *, share_bytes: int = SPLIT_BYTES) -> None:
        self._threads = threads
        self._share_bytes = share_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="kvsidecar-helper")

    def share(self, work: Callable[[numpy.ndarray | None], int], runs: int, values: int,
              nbytes: int) -> None:
        """``work(progress)`` in this thread, and with the helpers when the batch is
        large enough: ``progress`` is the int64 ``[runs, 2]`` every caller shares (None:
        not shared), through which the ``values`` of the runs are claimed."""
        if values < 2 or nbytes < self._share_bytes:
            work(None)
            return
        progress = numpy.zeros((runs, 2), dtype=numpy.int64)
        helpers = [self._pool.submit(work, progress) for _ in range(self._threads)]
        work(progress)
        running = [helper for helper in helpers if not helper.cancel()]
        # A helper still running has claimed a value: its pages are read until it is done.
        if not _blockcopy.wait_done(progress, values, SHARED_SPIN_S):
            concurrent.futures.wait(running)

    def digests(self, pages: numpy.ndarray, sizes: numpy.ndarray, seed: int,
                out: numpy.ndarray) -> None:
        """``_blockcopy.digests``, shared with the helpers when large enough."""
        self.share(lambda progress: _blockcopy.digests(
            pages, sizes, seed, out, None if progress is None else progress[0]),
            1, len(pages), len(pages) * int(sizes.sum()))

    def close(self) -> None:
        self._pool.shutdown()


def _digests(geometry: StoreGroupGeometry, pages: numpy.ndarray, seed: int,
             helpers: HelperThreads | None) -> Any:
    """The checksum of each block's pages (``page_addresses``) as they lie in the
    engine: uint64 each."""
    digests = numpy.empty(len(pages), dtype=numpy.uint64)
    digest = _blockcopy.digests if helpers is None else helpers.digests
    digest(numpy.ascontiguousarray(pages), geometry.segment_table[3], seed, digests)
    return digests


def row_digests(runs: Sequence[torch.Tensor], payload_bytes: int, seed: int,
                helpers: HelperThreads | None = None) -> numpy.ndarray:
    """The checksum of each row's first ``payload_bytes``, rows of host memory (uint8
    matrices, one a run, in order), as ``integrity.seal_rows`` seals it: uint64 each,
    computed in C without the GIL, with ``helpers`` sharing a large batch."""
    addresses = numpy.concatenate([
        rows.data_ptr() + rows.stride(0) * numpy.arange(rows.shape[0], dtype=numpy.int64)
        for rows in runs
    ]) if runs else numpy.empty(0, dtype=numpy.int64)
    digests = numpy.empty(len(addresses), dtype=numpy.uint64)
    if len(addresses):
        digest = _blockcopy.digests if helpers is None else helpers.digests
        digest(addresses.reshape(-1, 1), numpy.array([payload_bytes], dtype=numpy.int64),
               seed, digests)
    return digests


def seal_in_place(geometry: StoreGroupGeometry, pages: numpy.ndarray, trailers: torch.Tensor,
                  positions: Sequence[int], *, helpers: HelperThreads | None = None) -> None:
    """Seal value i, at each of ``positions``, in place: the checksum of its engine
    block's pages (row i of ``pages``, the batch's ``page_addresses``) into the first 8
    bytes of row i of ``trailers`` (uint8, a row per value), in one write. (A load
    measures what arrived the same way, into the 8 bytes after the trailer that came
    with it.) ``helpers`` share a large batch's checksums."""
    seed = geometry.checksum_seed
    assert seed is not None, "values without checksums have no trailer to seal"
    at = list(positions)
    digests = _digests(geometry, pages[at], seed, helpers)
    trailers.numpy()[at, :CHECKSUM_BYTES] = digests.view(numpy.uint8).reshape(-1, CHECKSUM_BYTES)


def read_in_place(geometry: StoreGroupGeometry, pages: numpy.ndarray,
                  rows: torch.Tensor | None, positions: Sequence[int],
                  sources: Sequence[int], *, helpers: HelperThreads | None = None) -> None:
    """Copy value i (at each of ``positions``), which lies whole at ``sources[k]`` in this
    process's memory (its pages back to back, then its checksum), into its engine
    block's pages (row i of ``pages``, the batch's ``page_addresses``), checking it first
    as a load from a lending store does
    (``verify_and_scatter``): one pass over the value, which is the store's move and the
    measure of ``seal_in_place`` at once. ``rows``: a loaded batch's trailer rows (uint8
    ``[values, 16]``, None without checksums). Row i gets the value's checksum, then what
    its pages measure: the same bytes when the value is intact. A value that is not is
    not copied at all, and its two halves differ. ``helpers`` share a large batch."""
    seed = geometry.checksum_seed
    offsets, sizes = geometry.segment_table[2:]
    at = numpy.asarray(positions, dtype=numpy.int64)
    pages = pages[at]  # a copy of the rows asked for, contiguous
    if rows is not None:  # the checksum after the pages goes into the value's trailer
        trailers = rows.data_ptr() + rows.stride(0) * at
        pages = numpy.ascontiguousarray(numpy.column_stack([pages, trailers]))
        offsets = numpy.append(offsets, geometry.value_bytes)
        sizes = numpy.append(sizes, CHECKSUM_BYTES)
    count = len(positions)
    intact = bytearray(count)
    stream = count * geometry.value_bytes >= LOAD_STREAM_BYTES
    slots = memoryview(intact)

    def work(progress: numpy.ndarray | None) -> int:
        # Each value is a run of its own: the store places values apart.
        return sum(_blockcopy.scatter(pages[k : k + 1], sources[k], 0, offsets, sizes,
                                      seed is not None, seed or 0, geometry.value_bytes,
                                      slots[k : k + 1], stream,
                                      None if progress is None else progress[k])
                   for k in range(count))

    if helpers is None:
        work(None)
    else:
        helpers.share(work, count, count, count * geometry.value_bytes)
    if rows is not None:
        table = rows.numpy()
        ok = numpy.frombuffer(intact, dtype=numpy.bool_)
        table[at[ok], CHECKSUM_BYTES:] = table[at[ok], :CHECKSUM_BYTES]
        table[at[~ok]] = [0] * CHECKSUM_BYTES + [0xFF] * CHECKSUM_BYTES


class InPlaceCopyEngine:
    """The copy engine of values the store moves straight out of and into the engine's
    blocks (``InPlaceMemory``): there is nothing to copy, and checksums are worked out
    within the store's own calls, where the pages lie (``seal_in_place``).

    A save has nothing to gather: the put seals each value the store lacks. A load's
    row is the value's sealed trailer, then the checksum its pages measured where they
    landed, so the check compares the two: a block that fails is reported failed, and
    the engine recomputes it before it reads it (the bytes did reach its memory, unlike
    with a copying engine).
    """

    def waits(self, nbytes: int) -> bool:
        return False  # the checks are made on the event loop; the store moved the bytes

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     runs: Sequence[Run]) -> None:
        pass

    async def unchanged(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                        runs: Sequence[Run]) -> list[bool]:
        return [True] * len(block_ids)  # nothing copied yet: the put reads the blocks

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      runs: Sequence[Run]) -> list[bool]:
        if geometry.checksum_seed is None:
            return [True] * len(block_ids)
        intact: list[bool] = []
        for run in runs:
            table = run.rows.numpy()
            intact += (table[:, :CHECKSUM_BYTES] == table[:, CHECKSUM_BYTES:]).all(1).tolist()
        return intact
