"""Transfer between engine KV tensors and the staging pool (the CPU copy engine).

Saves gather engine blocks into a staging slot; loads scatter a slot into engine blocks.
Copies run in worker threads (torch releases the GIL), one ``index_select`` /
``index_copy_`` per segment for the whole batch, straight into or out of the slot. Both
sides are seen as the widest integer words the geometry allows: torch moves uint8 rows
element by element, several times slower than the same bytes as 8-byte words.
"""

from __future__ import annotations

import dataclasses

import anyio
import torch

from pipeline.config import TransferStageConfig
from pipeline.integrity import seal_rows
from pipeline.jobs import BlockTask, JobTracker, StorePressure
from pipeline.sessions import StoreGroupGeometry
from pipeline.staging import Slot, StagingPool
from pipeline.store import LOADED, STORE_FULL, BlockStatus, KeyOutcome

__all__ = ["ScatterStage", "StagedBatch", "TransferStage", "gather_blocks", "scatter_blocks"]

STAGING_FULL = KeyOutcome(BlockStatus.SKIPPED, "staging_full")


@dataclasses.dataclass(slots=True, eq=False)
class StagedBatch:
    """A batch of one session's store group, its values as rows of a staging slot."""

    tasks: list[BlockTask]
    slot: Slot
    rows: torch.Tensor

    @property
    def geometry(self) -> StoreGroupGeometry:
        return self.tasks[0].geometry


def _index(tasks: list[BlockTask]) -> torch.Tensor:
    return torch.tensor([task.block_id for task in tasks], dtype=torch.int64)


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
    geometry: StoreGroupGeometry, block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """rows[i] = the value of engine block block_ids[i] (all segments, in order)."""
    for segment in geometry.segments:
        blocks, out = _as_words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        torch.index_select(blocks, 0, block_ids, out=out)


def scatter_blocks(
    geometry: StoreGroupGeometry, block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """Engine block block_ids[i] = rows[i] (the inverse of ``gather_blocks``)."""
    for segment in geometry.segments:
        blocks, source = _as_words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        blocks.index_copy_(0, block_ids, source)


def gather_and_seal(
    geometry: StoreGroupGeometry, block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    gather_blocks(geometry, block_ids, rows)
    if geometry.checksum_seed is not None:
        seal_rows(rows, geometry.value_bytes, geometry.checksum_seed)


class TransferStage:
    """Save side: engine blocks -> a staging slot."""

    def __init__(
        self,
        pool: StagingPool,
        tracker: JobTracker,
        limiter: anyio.CapacityLimiter,
        config: TransferStageConfig,
        pressure: StorePressure,
    ) -> None:
        self._pool = pool
        self._tracker = tracker
        self._limiter = limiter
        self._skip_when_full = config.overflow == "skip"
        self._pressure = pressure

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        skipped, tasks = self._pressure.split(tasks)
        if skipped:
            await self._tracker.settle_all(skipped, STORE_FULL)
        if not tasks:
            return None
        if self._skip_when_full:
            slot = self._pool.try_take("save")
            if slot is None:
                await self._tracker.settle_all(tasks, STAGING_FULL)
                return None
        else:
            slot = await self._pool.take("save")
        try:
            geometry = tasks[0].geometry
            rows = slot.rows(len(tasks), geometry.stored_bytes)
            await anyio.to_thread.run_sync(
                gather_and_seal, geometry, _index(tasks), rows, limiter=self._limiter
            )
        except BaseException:
            self._pool.release(slot)
            raise
        return StagedBatch(tasks, slot, rows)


class ScatterStage:
    """Load side: the loaded rows of a staging slot -> engine blocks."""

    def __init__(
        self, pool: StagingPool, tracker: JobTracker, limiter: anyio.CapacityLimiter
    ) -> None:
        self._pool = pool
        self._tracker = tracker
        self._limiter = limiter

    async def process(self, batch: StagedBatch) -> None:
        try:
            await anyio.to_thread.run_sync(
                scatter_blocks, batch.geometry, _index(batch.tasks), batch.rows,
                limiter=self._limiter,
            )
        finally:
            self._pool.release(batch.slot)
        await self._tracker.settle_all(batch.tasks, LOADED)
