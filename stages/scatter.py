"""Scatter (load side): verified values into engine blocks.

A value that does not match its checksum is never copied (one moved in place already
lies in the block, unread): its block is reported failed (the engine recomputes it) and
the value is removed from the store, so that a fresh save can replace it. No block of a
request stopped or past its deadline is written (``JobTracker.enter``): it is reported
failed, and a copy started is finished.
"""

from __future__ import annotations

import contextlib

from pipeline.core.errors import StoreError
from pipeline.core.outcomes import LOADED, MEMORY_LOST, BlockStatus, KeyOutcome
from pipeline.core.runs import select
from pipeline.core.seams import CopyEngine, Count, count_nothing
from pipeline.core.store import KVStore
from pipeline.state.events import KVEventLog
from pipeline.state.jobs import BlockTask, JobTracker, StagedBatch

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
        tracker = self._tracker
        try:
            passed, out, outcomes = tracker.enter(batch.tasks)
            try:
                if out:
                    await tracker.settle_each(out, outcomes)
                if not passed:
                    return
                intact = await self._scatter(batch, passed)
            finally:
                batch.values.release()
                tracker.leave(passed)
            await self._settle(batch, passed, intact)
        finally:
            await tracker.finish_stopped(batch.tasks)

    async def _scatter(self, batch: StagedBatch, tasks: list[BlockTask]) -> list[bool]:
        """Copy the values of ``tasks`` (all of the batch's, or some) into their blocks:
        whether each was intact."""
        if len(tasks) == len(batch.tasks):
            return await self._copy.scatter(batch.geometry, batch.block_ids, batch.runs)
        kept = set(map(id, tasks))
        positions = [i for i, task in enumerate(batch.tasks) if id(task) in kept]
        return await self._copy.scatter(batch.geometry, [task.block_id for task in tasks],
                                        select(batch.runs, positions))

    async def _settle(self, batch: StagedBatch, tasks: list[BlockTask], intact: list[bool]
                      ) -> None:
        if batch.session.memory_lost():
            await self._tracker.settle_all(tasks, MEMORY_LOST)
            return
        corrupt = [task for task, ok in zip(tasks, intact, strict=True) if not ok]
        self._copied((len(tasks) - len(corrupt)) * batch.geometry.stored_bytes)
        if corrupt:
            keys = [task.key for task in corrupt]
            with contextlib.suppress(StoreError):  # the next load finds it and tries again
                await self._store.remove(keys)
                self._events.removed(keys)
            await self._tracker.settle_all(corrupt, CHECKSUM_MISMATCH)
        await self._tracker.settle_all(
            [task for task, ok in zip(tasks, intact, strict=True) if ok], LOADED
        )
