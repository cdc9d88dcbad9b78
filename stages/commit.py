"""Commit: make a batch's values stored and settle each block's outcome.

Staged values are put into the store; values written straight into store memory are
committed (made readable) instead.
"""

from __future__ import annotations

from pipeline.errors import StoreError
from pipeline.jobs import JobTracker, StorePressure
from pipeline.staging import StagingPool
from pipeline.store import DirectKVStore, KVStore, store_error_outcome
from stages.transfer import StagedBatch, withhold_if_abandoned

__all__ = ["CommitStage"]


class CommitStage:
    def __init__(
        self,
        store: KVStore,
        pool: StagingPool,
        tracker: JobTracker,
        pressure: StorePressure,
        direct: DirectKVStore | None = None,
    ) -> None:
        self._store = store
        self._pool = pool
        self._tracker = tracker
        self._pressure = pressure
        self._direct = direct

    async def process(self, batch: StagedBatch) -> None:
        if batch.extents is not None and self._direct is not None:
            committed = self._direct.commit(batch.extents, written=True)
            outcomes = [o for o, view in zip(committed, batch.extents.views, strict=True)
                        if view is not None]
        else:
            try:
                outcomes = await self._store.put([task.key for task in batch.tasks], batch.views)
            except StoreError as exc:
                outcomes = [store_error_outcome(exc, saving=True)] * len(batch.tasks)
                withhold_if_abandoned(batch, self._pool, exc)
            finally:
                if batch.slot is not None:
                    self._pool.release(batch.slot)
        self._pressure.record(batch.tasks, outcomes)
        for task, outcome in zip(batch.tasks, outcomes, strict=True):
            await self._tracker.settle(task.job, ((task, outcome),))
