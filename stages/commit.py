"""Commit: make a batch's values stored and settle each block's outcome."""

from __future__ import annotations

from pipeline.core.seams import BatchMemory
from pipeline.state.jobs import JobTracker, StagedBatch, StorePressure

__all__ = ["CommitStage"]


class CommitStage:
    def __init__(
        self, memory: BatchMemory, tracker: JobTracker, pressure: StorePressure
    ) -> None:
        self._memory = memory
        self._tracker = tracker
        self._pressure = pressure

    async def process(self, batch: StagedBatch) -> None:
        outcomes = await self._memory.store(batch.values)
        self._pressure.record(batch.tasks, outcomes)
        await self._tracker.settle_each(batch.tasks, outcomes)
