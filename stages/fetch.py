"""Fetch: bring a batch's stored values within reach of the scatter.

Only blocks the store has travel on; the others settle here as failed, so the engine
recomputes them and never uses undefined bytes. (Checksums are verified by the
scatter, on the bytes the engine ends up holding.) Values moved in place are written
into the engine's blocks by the store call itself: that call is a copy, which starts
only for requests neither stopped nor past their deadline (``JobTracker.enter``).
"""

from __future__ import annotations

from pipeline.core.outcomes import BlockStatus, KeyOutcome
from pipeline.core.seams import BatchMemory, Count, count_nothing
from pipeline.state.jobs import BlockTask, JobTracker, StagedBatch

__all__ = ["FetchStage"]


class FetchStage:
    def __init__(
        self, memory: BatchMemory, tracker: JobTracker, *, fetched: Count = count_nothing,
        writes_engine: bool = False,
    ) -> None:
        """``fetched`` hears the bytes of the values each store call brought.
        ``writes_engine``: ``memory`` moves values in place, its store call writing the
        engine's blocks."""
        self._memory = memory
        self._tracker = tracker
        self._fetched = fetched
        self._writes_engine = writes_engine

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        if not self._writes_engine:
            return await self._fetch(tasks)
        tracker = self._tracker
        try:
            passed, out, outcomes = tracker.enter(tasks)
            try:
                if out:
                    await tracker.settle_each(out, outcomes)
                return await self._fetch(passed) if passed else None
            finally:
                tracker.leave(passed)
        finally:
            await tracker.finish_stopped(tasks)

    async def _fetch(self, tasks: list[BlockTask]) -> StagedBatch | None:
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
