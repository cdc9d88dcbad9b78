"""Transfer between engine KV tensors and stored values (the CPU copy engine).

Values live in a staging slot, or — when the store lends its memory (the embedded
store) — in the store itself, which saves one copy each way. Saves gather engine blocks
into the values; loads scatter values into engine blocks. Copies run in worker threads
(torch releases the GIL), one ``index_select`` / ``index_copy_`` per segment for each run
of adjacent values, a batch's segments split across threads (``CopyThreads``). Both
sides are seen as the widest integer words the geometry allows: torch moves uint8 rows
element by element, several times slower than words."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence

import anyio
import torch

from pipeline.config import TransferStageConfig
from pipeline.errors import StoreCallAbandoned, StoreError
from pipeline.integrity import seal_rows, verify_rows
from pipeline.jobs import BlockTask, JobTracker, StorePressure
from pipeline.sessions import Segment, StoreGroupGeometry
from pipeline.staging import Slot, StagingPool
from pipeline.store import (
    LOADED,
    STORE_FULL,
    BlockStatus,
    DirectKVStore,
    Extents,
    KeyOutcome,
    KVStore,
)

__all__ = [
    "CopyThreads",
    "ScatterStage",
    "StagedBatch",
    "TransferStage",
    "gather_blocks",
    "release_values",
    "runs",
    "scatter_blocks",
    "withhold_if_abandoned",
]

STAGING_FULL = KeyOutcome(BlockStatus.SKIPPED, "staging_full")
CHECKSUM_MISMATCH = KeyOutcome(BlockStatus.FAILED, "checksum_mismatch")


@dataclasses.dataclass(slots=True, eq=False)
class StagedBatch:
    """A batch of one session's store group with a value per block, held in a staging
    slot (``slot``) or in memory the store lent (``extents``)."""

    tasks: list[BlockTask]
    views: list[torch.Tensor]
    """Value i belongs to tasks[i]: 1-D uint8, ``geometry.stored_bytes`` long."""
    slot: Slot | None = None
    extents: Extents | None = None

    @property
    def geometry(self) -> StoreGroupGeometry:
        return self.tasks[0].geometry


def _index(tasks: Sequence[BlockTask]) -> torch.Tensor:
    return torch.tensor([task.block_id for task in tasks], dtype=torch.int64)


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


class TransferStage:
    """Save side: engine blocks -> values (staging, or store memory when lent)."""

    def __init__(
        self,
        pool: StagingPool,
        tracker: JobTracker,
        limiter: anyio.CapacityLimiter,
        config: TransferStageConfig,
        pressure: StorePressure,
        direct: DirectKVStore | None = None,
    ) -> None:
        self._pool = pool
        self._tracker = tracker
        self._copy = CopyThreads(limiter)
        self._skip_when_full = config.overflow == "skip"
        self._yield_s = config.yield_to_loads_ms / 1000
        self._pressure = pressure
        self._direct = direct

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        skipped, tasks = self._pressure.split(tasks)
        if skipped:
            await self._tracker.settle_all(skipped, STORE_FULL)
        if not tasks:
            return None
        await self._tracker.yield_to_loads(self._yield_s)
        batch = await (self._reserve(tasks) if self._direct else self._stage(tasks))
        if batch is None:
            return None
        try:
            await gather_and_seal(self._copy, batch.geometry, _index(batch.tasks), batch.views)
        except BaseException:
            release_values(batch, self._pool, self._direct)
            raise
        return batch

    async def _stage(self, tasks: list[BlockTask]) -> StagedBatch | None:
        if self._skip_when_full:
            slot = self._pool.try_take("save")
            if slot is None:
                await self._tracker.settle_all(tasks, STAGING_FULL)
                return None
        else:
            slot = await self._pool.take("save")
        rows = slot.rows(len(tasks), tasks[0].geometry.stored_bytes)
        return StagedBatch(tasks, list(rows.unbind(0)), slot=slot)

    async def _reserve(self, tasks: list[BlockTask]) -> StagedBatch | None:
        assert self._direct is not None
        extents = await self._direct.reserve(
            [task.key for task in tasks], tasks[0].geometry.stored_bytes
        )
        kept: list[BlockTask] = []
        views: list[torch.Tensor] = []
        refused: list[tuple[BlockTask, KeyOutcome]] = []
        for task, view, outcome in zip(tasks, extents.views, extents.outcomes, strict=True):
            if view is None:
                refused.append((task, outcome))
            else:
                kept.append(task)
                views.append(view)
        if refused:
            self._pressure.record([t for t, _ in refused], [o for _, o in refused])
            for task, outcome in refused:
                await self._tracker.settle(task.job, ((task, outcome),))
        if not kept:
            return None
        return StagedBatch(kept, views, extents=extents)


class ScatterStage:
    """Load side: verified values -> engine blocks.

    A value that does not match its checksum is never copied: its block is reported
    failed (the engine recomputes it) and the value is removed from the store, so that
    a fresh save can replace it.
    """

    def __init__(
        self,
        store: KVStore,
        pool: StagingPool,
        tracker: JobTracker,
        limiter: anyio.CapacityLimiter,
        direct: DirectKVStore | None = None,
    ) -> None:
        self._store = store
        self._pool = pool
        self._tracker = tracker
        self._copy = CopyThreads(limiter)
        self._direct = direct

    async def process(self, batch: StagedBatch) -> None:
        try:
            intact = await verify_and_scatter(
                self._copy, batch.geometry, _index(batch.tasks), batch.views
            )
        finally:
            release_values(batch, self._pool, self._direct)
        corrupt = [task for task, ok in zip(batch.tasks, intact, strict=True) if not ok]
        if corrupt:
            with contextlib.suppress(StoreError):  # the next load finds it and tries again
                await self._store.remove([task.key for task in corrupt])
            await self._tracker.settle_all(corrupt, CHECKSUM_MISMATCH)
        await self._tracker.settle_all(
            [task for task, ok in zip(batch.tasks, intact, strict=True) if ok], LOADED
        )


def release_values(
    batch: StagedBatch, pool: StagingPool, direct: DirectKVStore | None
) -> None:
    """Give back the memory holding a batch's values without storing them: a staging
    slot, a load's lease, or a save's reservation (left unwritten)."""
    if batch.slot is not None:
        pool.release(batch.slot)
    if batch.extents is not None and direct is not None:
        if batch.tasks[0].job.is_load:
            direct.release(batch.extents)
        else:
            direct.commit(batch.extents, written=False)


def withhold_if_abandoned(batch: StagedBatch, pool: StagingPool, error: StoreError) -> None:
    """After a store call on the batch's slot failed: if the call was abandoned (it may
    still touch the slot), keep the slot out of use until it returns."""
    if isinstance(error, StoreCallAbandoned) and batch.slot is not None:
        pool.withhold(batch.slot, until=error.when_returned)
        batch.slot = None
