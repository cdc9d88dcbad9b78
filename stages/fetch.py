"""Fetch: bring a batch's stored values within reach of the scatter.

Only blocks the store has travel on; the others settle here as failed, so the engine
recomputes them and never uses undefined bytes. (Checksums are verified by the
scatter, on the bytes the engine ends up holding.)
"""

from __future__ import annotations

from pipeline.core.outcomes import BlockStatus, KeyOutcome
from pipeline.core.seams import BatchMemory, Count, count_nothing
from pipeline.state.jobs import BlockTask, JobTracker, StagedBatch

__all__ = ["FetchStage"]


class FetchStage:
    def __init__(
        self, memory: BatchMemory, tracker: JobTracker, *, fetched: Count = count_nothing
    ) -> None:
        """``fetched`` hears the bytes of the values each store call brought."""
        self._memory = memory
        self._tracker = tracker
        self._fetched = fetched

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        values = await self._memory.fetch(
            tasks[0].geometry, [task.block_id for task in tasks], [task.key for task in tasks]
        )
        batch, missed, outcomes = StagedBatch.split(tasks, values, BlockStatus.LOADED)
        if batch is not None:
            self._fetched(len(batch.tasks) * batch.geometry.stored_bytes)
        try:
            await self._tracker.settle_each(missed, [_as_failure(o) for o in outcomes])
        except BaseException:
            values.release()
            raise
        return batch


def _as_failure(outcome: KeyOutcome) -> KeyOutcome:
    if outcome.status is BlockStatus.FAILED:
        return outcome
    return KeyOutcome(BlockStatus.FAILED, outcome.reason or str(outcome.status))
