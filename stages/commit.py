"""Commit: put a staged batch into the store and settle each block's outcome."""

from __future__ import annotations

from pipeline.errors import StoreError
from pipeline.jobs import JobTracker, StorePressure
from pipeline.staging import StagingPool
from pipeline.store import KVStore, store_error_outcome
from stages.transfer import StagedBatch

__all__ = ["CommitStage"]


class CommitStage:
    def __init__(
        self, store: KVStore, pool: StagingPool, tracker: JobTracker, pressure: StorePressure
    ) -> None:
        self._store = store
        self._pool = pool
        self._tracker = tracker
        self._pressure = pressure

    async def process(self, batch: StagedBatch) -> None:
        try:
            outcomes = await self._store.put(
                [task.key for task in batch.tasks], list(batch.rows.unbind(0))
            )
        except StoreError as exc:
            outcomes = [store_error_outcome(exc, saving=True)] * len(batch.tasks)
        finally:
            self._pool.release(batch.slot)
        self._pressure.record(batch.tasks, outcomes)
        for task, outcome in zip(batch.tasks, outcomes, strict=True):
            await self._tracker.settle(task.job, ((task, outcome),))
