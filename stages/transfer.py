"""Transfer (save side): engine blocks into values, in the batch memory.

Requests under store pressure skip without copying; a save waits while loads are in
flight (for at most ``yield_to_loads_ms``), so loads get the cores first.
"""

from __future__ import annotations

from pipeline.core.outcomes import INTERNAL, MEMORY_LOST, STORE_FULL, BlockStatus
from pipeline.core.seams import BatchMemory, CopyEngine, Count, count_nothing
from pipeline.state.jobs import BlockTask, JobTracker, StagedBatch, StorePressure

__all__ = ["TransferStage"]


class TransferStage:
    def __init__(
        self,
        memory: BatchMemory,
        copy: CopyEngine,
        tracker: JobTracker,
        pressure: StorePressure,
        *,
        yield_to_loads_s: float = 0.0,
        copied: Count = count_nothing,
    ) -> None:
        """``copied`` hears the bytes of each batch copied out of the engine."""
        self._memory = memory
        self._copy = copy
        self._tracker = tracker
        self._pressure = pressure
        self._yield_s = yield_to_loads_s
        self._copied = copied

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        skipped, tasks = self._pressure.split(tasks)
        if skipped:
            await self._tracker.settle_all(skipped, STORE_FULL)
        if not tasks:
            return None
        await self._tracker.yield_to_loads(self._yield_s)
        values = await self._memory.reserve(
            tasks[0].geometry, [task.block_id for task in tasks], [task.key for task in tasks]
        )
        batch, refused, outcomes = StagedBatch.split(tasks, values, BlockStatus.STORED)
        if refused:
            self._pressure.record(refused, outcomes)
            await self._tracker.settle_each(refused, outcomes)
        if batch is None:
            return None
        try:
            await self._copy.gather(batch.geometry, batch.block_ids, batch.runs)
        except BaseException:
            values.release()
            raise
        if batch.session.memory_lost() or batch.abandoned():
            values.release()
            await self._tracker.settle_all(
                batch.tasks, MEMORY_LOST if batch.session.memory_lost() else INTERNAL)
            return None
        self._copied(len(batch.tasks) * batch.geometry.stored_bytes)
        return batch
