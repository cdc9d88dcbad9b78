"""The CPU copy engine: engine KV blocks to and from stored values, in worker threads.

Saves gather engine blocks into the values; loads scatter values into engine blocks.
Copies run in worker threads (torch releases the GIL), one ``index_select`` /
``index_copy_`` per segment for each run of adjacent values, a batch's segments split
across threads (``CopyThreads``). Both sides are seen as the widest integer words the
geometry allows: torch moves uint8 rows element by element, several times slower than
words."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import anyio
import torch

from pipeline.core.geometry import Segment, StoreGroupGeometry
from pipeline.core.integrity import seal_rows, verify_rows

__all__ = [
    "CopyThreads",
    "CpuCopyEngine",
    "gather_and_seal",
    "gather_blocks",
    "runs",
    "scatter_blocks",
    "verify_and_scatter",
]


def _index(block_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64)


def runs(views: Sequence[torch.Tensor], size: int) -> list[tuple[int, torch.Tensor]]:
    """Adjacent values as matrices: (index of the first, a [count, size] view)."""
    result = []
    start = 0
    for index in range(1, len(views) + 1):
        if index == len(views) or views[index].data_ptr() != views[index - 1].data_ptr() + size:
            matrix = torch.as_strided(views[start], (index - start, size), (size, 1))
            result.append((start, matrix))
            start = index
    return result


_WORDS = (torch.int64, torch.int32, torch.int16)


def _as_words(blocks: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both byte matrices as the widest integer type whose view fits both (same bytes)."""
    for dtype in _WORDS:
        try:
            return blocks.view(dtype), columns.view(dtype)
        except RuntimeError:
            continue  # a size, stride or offset not a multiple of the word
    return blocks, columns


def gather_blocks(
    segments: Sequence[Segment], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """rows[i] = the pages of engine block block_ids[i] in these segments."""
    for segment in segments:
        blocks, out = _as_words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        torch.index_select(blocks, 0, block_ids, out=out)


def scatter_blocks(
    segments: Sequence[Segment], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """Engine block block_ids[i] = rows[i] in these segments (the inverse of gather)."""
    for segment in segments:
        blocks, source = _as_words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        blocks.index_copy_(0, block_ids, source)


SPLIT_BYTES = 8 << 20
"""Batches smaller than this are copied by one thread: a split costs thread hand-offs
(~0.1 ms each on a small machine) that a small copy does not earn back."""

Step = Callable[[int, int], None]
"""One phase of a copy: ``step(part, parts)`` does its share."""


class CopyThreads:
    """Runs one batch's copy split across worker threads.

    Torch runs single-threaded in the sidecar (see ``service``): a batch is copied one
    segment (layer) at a time, and an OpenMP team per call costs a wake-up per layer. Split
    here instead — segments for copies, rows for checksums — the threads stay busy for
    the whole batch, and they are bounded by one limiter per direction.
    """

    def __init__(self, limiter: anyio.CapacityLimiter, split_bytes: int = SPLIT_BYTES) -> None:
        self._limiter = limiter
        self._parts = max(1, int(limiter.total_tokens))
        self._split_bytes = split_bytes

    async def run(self, nbytes: int, *steps: Step) -> None:
        """Each step in every part, the steps one after another; a batch below
        ``split_bytes`` runs all of them in one thread."""
        parts = self._parts if nbytes >= self._split_bytes else 1
        if parts == 1:
            await anyio.to_thread.run_sync(_in_order, steps, limiter=self._limiter)
            return
        for step in steps:
            async with anyio.create_task_group() as tg:
                for part in range(parts):
                    tg.start_soon(functools.partial(
                        anyio.to_thread.run_sync, step, part, parts, limiter=self._limiter
                    ))


def _in_order(steps: Sequence[Step]) -> None:
    for step in steps:
        step(0, 1)


def _gather_part(geometry: StoreGroupGeometry, block_ids: torch.Tensor,
                 views: Sequence[torch.Tensor], part: int, parts: int) -> None:
    for start, rows in runs(views, geometry.stored_bytes):
        ids = block_ids[start : start + rows.shape[0]]
        gather_blocks(geometry.segments[part::parts], ids, rows)


def _seal_part(geometry: StoreGroupGeometry, views: Sequence[torch.Tensor],
               part: int, parts: int) -> None:
    assert geometry.checksum_seed is not None
    for _, rows in runs(views, geometry.stored_bytes):
        seal_rows(rows[part::parts], geometry.value_bytes, geometry.checksum_seed)


def _verify_part(geometry: StoreGroupGeometry, views: Sequence[torch.Tensor],
                 intact: list[bool], part: int, parts: int) -> None:
    assert geometry.checksum_seed is not None
    for start, rows in runs(views, geometry.stored_bytes):
        checked = verify_rows(rows[part::parts], geometry.value_bytes, geometry.checksum_seed)
        intact[start + part : start + rows.shape[0] : parts] = checked


def _scatter_part(geometry: StoreGroupGeometry, block_ids: torch.Tensor,
                  views: Sequence[torch.Tensor], intact: list[bool],
                  part: int, parts: int) -> None:
    """Copy the intact values into their engine blocks (this part's segments)."""
    keep = [index for index, ok in enumerate(intact) if ok]
    kept_ids = block_ids[keep] if len(keep) < len(views) else block_ids
    kept_views = [views[index] for index in keep]
    for start, rows in runs(kept_views, geometry.stored_bytes):
        ids = kept_ids[start : start + rows.shape[0]]
        scatter_blocks(geometry.segments[part::parts], ids, rows)


async def gather_and_seal(
    copy: CopyThreads, geometry: StoreGroupGeometry, block_ids: torch.Tensor,
    views: Sequence[torch.Tensor],
) -> None:
    """Fill each value from its engine block, then seal its checksum."""
    steps: list[Step] = [functools.partial(_gather_part, geometry, block_ids, views)]
    if geometry.checksum_seed is not None:
        steps.append(functools.partial(_seal_part, geometry, views))
    await copy.run(len(views) * geometry.stored_bytes, *steps)


async def verify_and_scatter(
    copy: CopyThreads, geometry: StoreGroupGeometry, block_ids: torch.Tensor,
    views: Sequence[torch.Tensor],
) -> list[bool]:
    """Check each value against its sealed checksum, then copy only the intact ones into
    their engine blocks: the engine never receives a corrupted byte. Whether each is intact.
    """
    intact = [True] * len(views)
    steps: list[Step] = []
    if geometry.checksum_seed is not None:
        steps.append(functools.partial(_verify_part, geometry, views, intact))
    steps.append(functools.partial(_scatter_part, geometry, block_ids, views, intact))
    await copy.run(len(views) * geometry.stored_bytes, *steps)
    return intact


class CpuCopyEngine:
    """The copy engine of CPU memory: torch copies in worker threads (``CopyThreads``)."""

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self._copy = CopyThreads(limiter)

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     views: Sequence[torch.Tensor]) -> None:
        await gather_and_seal(self._copy, geometry, _index(block_ids), views)

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      views: Sequence[torch.Tensor]) -> list[bool]:
        return await verify_and_scatter(self._copy, geometry, _index(block_ids), views)
