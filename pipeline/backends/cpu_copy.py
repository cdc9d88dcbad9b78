"""The CPU copy engine: engine KV blocks to and from stored values, in worker threads.

Saves gather engine blocks into the values and seal each value's checksum; loads verify
each value, then scatter the intact ones into engine blocks. A batch is cut into parts
of adjacent values, one worker thread each (``CopyThreads``): a thread checksums exactly
the values it copied, so a batch costs one hand-off per part, and a small batch none (it
is copied on the event loop, quicker than a hand-off). Per run of adjacent values, one
``index_select`` / ``index_copy_`` per segment moves every block, both sides seen as the
widest integer words the geometry allows (torch moves uint8 rows element by element,
several times slower than words)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import anyio
import torch

from pipeline.backends.threads import WorkerThreads
from pipeline.core.geometry import Segment, StoreGroupGeometry
from pipeline.core.integrity import CHECKSUM_BYTES, pages_digest, seal_rows, verify_rows
from pipeline.core.store import value_span

__all__ = [
    "CopyThreads",
    "CpuCopyEngine",
    "InPlaceCopyEngine",
    "Piece",
    "gather_and_seal",
    "gather_blocks",
    "runs",
    "scatter_blocks",
    "seal_in_place",
    "span_of",
    "verify_and_scatter",
]

Piece = tuple[int, torch.Tensor]
"""Adjacent values as one matrix: (index of the first, a ``[count, size]`` view)."""


def _index(block_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64)


def runs(views: Sequence[torch.Tensor], size: int) -> list[Piece]:
    """Adjacent values as matrices: (index of the first, a [count, size] view). Values
    are adjacent when each starts ``size`` bytes after the last, or ``value_span(size)``
    (a direct store's padded values): one stride per run."""
    strides = (size, value_span(size))
    result = []
    start = 0
    stride = size
    for index in range(1, len(views) + 1):
        if index < len(views):
            step = views[index].data_ptr() - views[index - 1].data_ptr()
            if step == stride or (index == start + 1 and step in strides):
                stride = step
                continue
        matrix = torch.as_strided(views[start], (index - start, size), (stride, 1))
        result.append((start, matrix))
        start, stride = index, size
    return result


def span_of(rows: torch.Tensor) -> torch.Tensor:
    """A run's rows with the padding after each (a direct store's own bytes) as one
    contiguous matrix, for copies that need one (to and from a GPU)."""
    count, stride = rows.shape[0], rows.stride(0)
    return torch.as_strided(rows, (count, stride), (stride, 1))


_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def _words(blocks: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both byte matrices as the widest integer type whose view fits both (same bytes):
    the word must divide the page, both row strides and both start offsets."""
    sizes = (blocks.shape[1], blocks.stride(0), blocks.storage_offset(),
             columns.stride(0), columns.storage_offset())
    for dtype, width in _WORDS:
        if all(size % width == 0 for size in sizes):
            return blocks.view(dtype), columns.view(dtype)
    return blocks, columns


def gather_blocks(
    segments: Sequence[Segment], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """rows[i] = the pages of engine block block_ids[i] in these segments."""
    for segment in segments:
        blocks, out = _words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        torch.index_select(blocks, 0, block_ids, out=out)


def scatter_blocks(
    segments: Sequence[Segment], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """Engine block block_ids[i] = rows[i] in these segments (the inverse of gather)."""
    for segment in segments:
        blocks, source = _words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        blocks.index_copy_(0, block_ids, source)


SPLIT_BYTES = 8 << 20
"""Batches smaller than this are copied by one thread: a split costs thread hand-offs
(~0.1 ms each on a small machine) that a small copy does not earn back."""
INLINE_BYTES = 512 << 10
"""Batches up to this size are copied on the event loop: the copy takes less time than
the hand-off to a worker thread would."""

Work = Callable[[Sequence[Piece]], None]
"""Copies some runs of a batch's values (a part), in whatever thread calls it."""


class CopyThreads:
    """Runs one batch's copy: small ones inline, others in parts, one worker thread each.

    Torch runs single-threaded in the sidecar (see ``service``): an OpenMP team per call
    would cost a wake-up per segment. A part is a range of adjacent values, so each
    thread checksums exactly the values it copied (no barrier between the copy and the
    checksums), and each direction has threads of its own (``WorkerThreads``).
    """

    def __init__(
        self, threads: WorkerThreads, split_bytes: int = SPLIT_BYTES,
        inline_bytes: int = INLINE_BYTES,
    ) -> None:
        self._threads = threads
        self._parts = threads.total
        self._split_bytes = split_bytes
        self._inline_bytes = inline_bytes

    async def run(self, views: Sequence[torch.Tensor], size: int, work: Work) -> None:
        """``work`` over every value (each ``size`` bytes), in parts."""
        nbytes = len(views) * size
        if nbytes <= self._inline_bytes:
            work(self._pieces(views, size))
            return
        parts = min(self._parts, len(views)) if nbytes >= self._split_bytes else 1
        if parts == 1:
            await self._threads.run(work, self._pieces(views, size))
            return
        bounds = [len(views) * part // parts for part in range(parts + 1)]
        async with anyio.create_task_group() as tg:
            for start, stop in itertools.pairwise(bounds):
                tg.start_soon(self._threads.run, work, self._pieces(views, size, start, stop))

    def _pieces(self, views: Sequence[torch.Tensor], size: int, start: int = 0,
                stop: int | None = None) -> list[Piece]:
        """Values ``start:stop`` as runs of adjacent values."""
        return [(start + first, rows) for first, rows in runs(views[start:stop], size)]


def _gather_and_seal(geometry: StoreGroupGeometry, block_ids: torch.Tensor,
                     pieces: Sequence[Piece]) -> None:
    seed = geometry.checksum_seed
    for start, rows in pieces:
        gather_blocks(geometry.segments, block_ids[start : start + rows.shape[0]], rows)
        if seed is not None:
            seal_rows(rows, geometry.value_bytes, seed)


def _verify_and_scatter(geometry: StoreGroupGeometry, block_ids: torch.Tensor,
                        intact: list[bool], pieces: Sequence[Piece]) -> None:
    seed = geometry.checksum_seed
    for start, rows in pieces:
        ids = block_ids[start : start + rows.shape[0]]
        if seed is not None:
            checked = verify_rows(rows, geometry.value_bytes, seed)
            intact[start : start + len(checked)] = checked
            if not all(checked):
                keep = torch.tensor([i for i, ok in enumerate(checked) if ok], dtype=torch.int64)
                ids, rows = ids[keep], rows[keep]  # rows[keep] copies only the intact values
        scatter_blocks(geometry.segments, ids, rows)


async def gather_and_seal(
    copy: CopyThreads, geometry: StoreGroupGeometry, block_ids: torch.Tensor,
    views: Sequence[torch.Tensor],
) -> None:
    """Fill each value from its engine block, then seal its checksum."""
    await copy.run(views, geometry.stored_bytes,
                   functools.partial(_gather_and_seal, geometry, block_ids))


async def verify_and_scatter(
    copy: CopyThreads, geometry: StoreGroupGeometry, block_ids: torch.Tensor,
    views: Sequence[torch.Tensor],
) -> list[bool]:
    """Check each value against its sealed checksum, then copy only the intact ones into
    their engine blocks: the engine never receives a corrupted byte. Whether each is intact.
    """
    intact = [True] * len(views)
    await copy.run(views, geometry.stored_bytes,
                   functools.partial(_verify_and_scatter, geometry, block_ids, intact))
    return intact


class CpuCopyEngine:
    """The copy engine of CPU memory: torch copies in worker threads (``CopyThreads``)."""

    def __init__(self, threads: WorkerThreads) -> None:
        self._copy = CopyThreads(threads)

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     views: Sequence[torch.Tensor]) -> None:
        await gather_and_seal(self._copy, geometry, _index(block_ids), views)

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      views: Sequence[torch.Tensor]) -> list[bool]:
        return await verify_and_scatter(self._copy, geometry, _index(block_ids), views)


def _digests(geometry: StoreGroupGeometry, block_ids: Sequence[int], seed: int) -> list[int]:
    """The checksum of each block's pages as they lie in the engine."""
    pages = [segment.blocks.numpy() for segment in geometry.segments]
    return [pages_digest([page[block] for page in pages], seed) for block in block_ids]


def seal_in_place(geometry: StoreGroupGeometry, block_ids: Sequence[int],
                  trailers: Sequence[torch.Tensor], positions: Sequence[int]) -> None:
    """Seal value i, at each of ``positions``, in place: the checksum of engine block
    ``block_ids[i]``'s pages into the first 8 bytes of ``trailers[i]``. (A load measures
    what arrived the same way, into the 8 bytes after the trailer that came with it.)"""
    seed = geometry.checksum_seed
    assert seed is not None, "values without checksums have no trailer to seal"
    digests = _digests(geometry, [block_ids[i] for i in positions], seed)
    sealed = torch.tensor(digests, dtype=torch.uint64).view(torch.uint8).view(-1, 8)
    for i, row in zip(positions, sealed, strict=True):
        trailers[i][:CHECKSUM_BYTES].copy_(row)


class InPlaceCopyEngine:
    """The copy engine of values the store moves straight out of and into the engine's
    blocks (``InPlaceMemory``): there is nothing to copy, and checksums are worked out
    within the store's own calls, where the pages lie (``seal_in_place``).

    A save has nothing to gather: the put seals each value the store lacks. A load's
    view is the value's sealed trailer, then the checksum its pages measured where they
    landed, so the check compares the two: a block that fails is reported failed, and
    the engine recomputes it before it reads it (the bytes did reach its memory, unlike
    with a copying engine).
    """

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     views: Sequence[torch.Tensor]) -> None:
        pass

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      views: Sequence[torch.Tensor]) -> list[bool]:
        if geometry.checksum_seed is None:
            return [True] * len(views)
        return [torch.equal(view[:CHECKSUM_BYTES], view[CHECKSUM_BYTES:]) for view in views]
