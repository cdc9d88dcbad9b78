"""Scatter (load side): verified values into engine blocks.

A value that does not match its checksum is never copied (one moved in place already
lies in the block, unread): its block is reported failed (the engine recomputes it) and
the value is removed from the store, so that a fresh save can replace it.
"""

from __future__ import annotations

import contextlib

from pipeline.core.errors import StoreError
from pipeline.core.outcomes import INTERNAL, LOADED, MEMORY_LOST, BlockStatus, KeyOutcome
from pipeline.core.seams import CopyEngine, Count, count_nothing
from pipeline.core.store import KVStore
from pipeline.state.events import KVEventLog
from pipeline.state.jobs import JobTracker, StagedBatch

__all__ = ["CHECKSUM_MISMATCH", "ScatterStage"]

CHECKSUM_MISMATCH = KeyOutcome(BlockStatus.FAILED, "checksum_mismatch")


class ScatterStage:
    def __init__(
        self, store: KVStore, copy: CopyEngine, tracker: JobTracker, events: KVEventLog,
        *, copied: Count = count_nothing,
    ) -> None:
        """``copied`` hears the bytes of the values copied into the engine."""
        self._store = store
        self._copy = copy
        self._tracker = tracker
        self._events = events
        self._copied = copied

    async def process(self, batch: StagedBatch) -> None:
        if batch.abandoned():  # blocks the engine may have reused meanwhile
            batch.values.release()
            await self._tracker.settle_all(batch.tasks, INTERNAL)
            return
        try:
            intact = await self._copy.scatter(batch.geometry, batch.block_ids, batch.runs)
        finally:
            batch.values.release()
        if batch.session.memory_lost():
            await self._tracker.settle_all(batch.tasks, MEMORY_LOST)
            return
        corrupt = [task for task, ok in zip(batch.tasks, intact, strict=True) if not ok]
        self._copied((len(batch.tasks) - len(corrupt)) * batch.geometry.stored_bytes)
        if corrupt:
            keys = [task.key for task in corrupt]
            with contextlib.suppress(StoreError):  # the next load finds it and tries again
                await self._store.remove(keys)
                self._events.removed(keys)
            await self._tracker.settle_all(corrupt, CHECKSUM_MISMATCH)
        await self._tracker.settle_all(
            [task for task, ok in zip(batch.tasks, intact, strict=True) if ok], LOADED
        )
