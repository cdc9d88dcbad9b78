"""Commit: make a batch's values stored, settle each block's outcome, and tell the KV
event log which blocks were stored.

A batch with a block of a stopped request is dropped whole, never stored. A store call
in flight counts as a copy of its jobs (``JobTracker.enter``): a cancel waits for it,
and is answered with what it did. Values moved in place are read from the engine by the
store call itself: that call starts only for requests neither stopped nor past their
deadline.
"""

from __future__ import annotations

import contextlib

from pipeline.core.errors import StoreError
from pipeline.core.outcomes import MEMORY_LOST, BlockStatus, KeyOutcome
from pipeline.core.seams import BatchMemory, Count, count_nothing
from pipeline.core.store import KVStore
from pipeline.state.events import KVEventLog
from pipeline.state.jobs import JobTracker, StagedBatch, StorePressure

__all__ = ["CommitStage"]


class CommitStage:
    def __init__(
        self, memory: BatchMemory, store: KVStore, tracker: JobTracker,
        pressure: StorePressure, events: KVEventLog, *, stored: Count = count_nothing,
        reads_engine: bool = False,
    ) -> None:
        """``stored`` hears the bytes of the values each store call stored. ``store`` is
        the one ``memory`` stores into. ``reads_engine``: ``memory`` moves values in
        place, its store call reading the engine's blocks."""
        self._memory = memory
        self._store = store
        self._tracker = tracker
        self._pressure = pressure
        self._events = events
        self._stored = stored
        self._reads_engine = reads_engine

    async def process(self, batch: StagedBatch) -> None:
        # The store call counts as a copy of the batch's jobs (a copy of engine memory,
        # for values moved in place), so that a cancel waits for it and is answered with
        # what it did, never "cancelled" for values it stored.
        tracker = self._tracker
        passed, out, _ = tracker.enter(batch.tasks, deadline=self._reads_engine)
        try:
            if out or len(passed) < len(batch.tasks):
                tracker.leave(passed)
                batch.values.release()
                await tracker.discard(batch.tasks)
                return
            try:
                await self._commit(batch)
            finally:
                tracker.leave(passed)
        finally:
            await tracker.finish_stopped(batch.tasks)

    async def _commit(self, batch: StagedBatch) -> None:
        if batch.abandoned():  # blocks the engine may have reused meanwhile
            batch.values.release()
            await self._tracker.discard(batch.tasks)
            return
        stored_bytes = batch.geometry.stored_bytes
        outcomes = await self._memory.store(batch.values)
        if batch.session.memory_lost():
            # Values moved in place were read from the engine by the store call itself.
            await self._forget_stored(batch, outcomes)
            await self._tracker.settle_all(batch.tasks, MEMORY_LOST)
            return
        self._pressure.record(batch.tasks, outcomes)
        stored = [task for task, outcome in zip(batch.tasks, outcomes, strict=True)
                  if outcome.status is BlockStatus.STORED]
        self._stored(len(stored) * stored_bytes)
        self._events.stored(stored)
        await self._tracker.settle_each(batch.tasks, outcomes)

    async def _forget_stored(self, batch: StagedBatch, outcomes: list[KeyOutcome]) -> None:
        """Remove what a store call just stored from memory that shrank meanwhile."""
        keys = [task.key for task, outcome in zip(batch.tasks, outcomes, strict=True)
                if outcome.status is BlockStatus.STORED]
        if keys:
            with contextlib.suppress(StoreError):  # a load of one would fail its checksum
                await self._store.remove(keys)
