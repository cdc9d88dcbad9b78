"""Commit: make a batch's values stored, settle each block's outcome, and tell the KV
event log which blocks were stored."""

from __future__ import annotations

from pipeline.core.outcomes import BlockStatus
from pipeline.core.seams import BatchMemory, Count, count_nothing
from pipeline.state.events import KVEventLog
from pipeline.state.jobs import JobTracker, StagedBatch, StorePressure

__all__ = ["CommitStage"]


class CommitStage:
    def __init__(
        self, memory: BatchMemory, tracker: JobTracker, pressure: StorePressure,
        events: KVEventLog, *, stored: Count = count_nothing,
    ) -> None:
        """``stored`` hears the bytes of the values each store call stored."""
        self._memory = memory
        self._tracker = tracker
        self._pressure = pressure
        self._events = events
        self._stored = stored

    async def process(self, batch: StagedBatch) -> None:
        outcomes = await self._memory.store(batch.values)
        self._pressure.record(batch.tasks, outcomes)
        stored = [task for task, outcome in zip(batch.tasks, outcomes, strict=True)
                  if outcome.status is BlockStatus.STORED]
        self._stored(len(stored) * batch.geometry.stored_bytes)
        self._events.stored(stored)
        await self._tracker.settle_each(batch.tasks, outcomes)
