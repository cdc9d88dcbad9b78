"""Fetch: bring a batch's stored values within reach of the scatter.

Only blocks the store has travel on; the others settle here as failed, so the engine
recomputes them and never uses undefined bytes. (Checksums are verified by the
scatter, on the bytes the engine ends up holding.) Values moved in place are written
into the engine's blocks by the store call itself: that call is a copy, which starts
only for requests neither stopped nor past their deadline (``JobTracker.enter``).
"""

from __future__ import annotations

from pipeline.core.outcomes import BlockStatus, KeyOutcome
from pipeline.core.seams import BatchMemory, Count, Values, count_nothing
from pipeline.state.jobs import BlockTask, JobTracker, StagedBatch, live

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
        tasks = live(tasks)
        if not tasks:
            return None
        if not self._writes_engine:
            return await self._fetch(tasks)
        tracker = self._tracker
        tasks, out, outcomes = tracker.screen(tasks)
        if out:
            await tracker.settle_each(out, outcomes)
        entered: list[BlockTask] = []

        def admit() -> bool:
            """After the slot wait: the copy starts only if no job of the batch was
            stopped meanwhile (``JobTracker.enter``)."""
            passed, stopped, _ = tracker.enter(tasks)
            if stopped or len(passed) < len(tasks):
                tracker.leave(passed)
                return False
            entered.extend(passed)
            return True

        try:
            if not tasks:
                return None
            values = await self._memory.fetch(
                tasks[0].geometry, [task.block_id for task in tasks],
                [task.key for task in tasks], admit=admit)
            if not entered:  # withdrawn: nothing reached the engine
                values.release()
                await tracker.discard(tasks)
                return None
            return await self._split(tasks, values)
        finally:
            if entered:
                tracker.leave(entered)
            await tracker.finish_stopped(tasks)

    async def _fetch(self, tasks: list[BlockTask]) -> StagedBatch | None:
        values = await self._memory.fetch(
            tasks[0].geometry, [task.block_id for task in tasks], [task.key for task in tasks])
        return await self._split(tasks, values)

    async def _split(self, tasks: list[BlockTask], values: Values) -> StagedBatch | None:
        """The tasks whose value came as a batch; the others settled failed."""
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
