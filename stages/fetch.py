"""Fetch: bring a batch's stored values within reach of the scatter.

Only blocks the store has travel on; the others settle here as failed, so the engine
recomputes them and never sees undefined bytes. (Checksums are verified by the
scatter, on the bytes the engine ends up holding.)
"""

from __future__ import annotations

from pipeline.core.outcomes import BlockStatus, KeyOutcome
from pipeline.core.seams import BatchMemory
from pipeline.state.jobs import BlockTask, JobTracker, StagedBatch

__all__ = ["FetchStage"]


class FetchStage:
    def __init__(self, memory: BatchMemory, tracker: JobTracker) -> None:
        self._memory = memory
        self._tracker = tracker

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        values = await self._memory.fetch(
            [task.key for task in tasks], tasks[0].geometry.stored_bytes
        )
        try:
            loaded: list[int] = []
            for i, (outcome, view) in enumerate(zip(values.outcomes, values.views, strict=True)):
                if outcome.status is BlockStatus.LOADED and view is not None:
                    loaded.append(i)
                else:
                    await self._tracker.settle(tasks[i].job, ((tasks[i], _as_failure(outcome)),))
        except BaseException:
            values.release()
            raise
        if not loaded:
            values.release()
            return None
        views = [values.views[i] for i in loaded]
        return StagedBatch([tasks[i] for i in loaded], [v for v in views if v is not None], values)


def _as_failure(outcome: KeyOutcome) -> KeyOutcome:
    if outcome.status is BlockStatus.FAILED:
        return outcome
    return KeyOutcome(BlockStatus.FAILED, outcome.reason or str(outcome.status))
