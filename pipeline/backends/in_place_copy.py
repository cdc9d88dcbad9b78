"""Values moved in place: straight between engine memory and the store (Mooncake's
multi-buffer calls), with no copy of the sidecar's own but the checksums, sealed into
and checked from trailers the sidecar keeps beside each value, and the copies of values
the store holds in this process's memory (``read_in_place``). A large batch's share of
that work is spread over helper threads (``HelperThreads``)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch

from pipeline.backends import _blockcopy
from pipeline.backends.cpu_copy import LOAD_STREAM_BYTES, SPLIT_BYTES
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.integrity import CHECKSUM_BYTES
from pipeline.core.runs import Run

__all__ = ["SHARED_SPIN_S", "HelperThreads", "InPlaceCopyEngine", "read_in_place",
           "row_digests", "seal_in_place"]

SHARED_SPIN_S = 0.0005
"""How long the store's thread, done with its share of a batch's work
(``HelperThreads``), spins for the last values in other threads' hands before it sleeps
until they are done: about two values' copy at 1 MiB, less than a sleeping thread takes
to be woken."""


class HelperThreads:
    """Threads that take part in a large batch's work in the store's thread, for values
    moved in place: their checksums (``seal_in_place``) and the copies of values the
    store holds in this process's memory (``read_in_place``), from ``share_bytes`` on.
    Each value goes to whichever thread claims it first (``_blockcopy``'s shared runs):
    the store's thread starts at once and never waits for a helper to wake, and a helper
    that has not started by the time every value is claimed is called off."""

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
