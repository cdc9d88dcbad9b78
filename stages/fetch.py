"""Fetch: bring a batch's stored values within reach of the scatter.

Values are copied into a staging slot, or — when the store lends its memory — leased
in place. Only blocks the store has travel on; the others settle here as failed, so the
engine recomputes them and never sees undefined bytes. (Checksums are verified by the
scatter, on the bytes the engine ends up holding.)
"""

from __future__ import annotations

import torch

from pipeline.errors import StoreError
from pipeline.jobs import BlockTask, JobTracker
from pipeline.staging import StagingPool
from pipeline.store import (
    BlockStatus,
    DirectKVStore,
    Extents,
    KeyOutcome,
    KVStore,
    store_error_outcome,
)
from stages.transfer import StagedBatch, release_values, withhold_if_abandoned

__all__ = ["FetchStage"]



class FetchStage:
    def __init__(
        self,
        store: KVStore,
        pool: StagingPool,
        tracker: JobTracker,
        direct: DirectKVStore | None = None,
    ) -> None:
        self._store = store
        self._pool = pool
        self._tracker = tracker
        self._direct = direct

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        batch, outcomes = await (self._lease(tasks) if self._direct else self._get(tasks))
        try:
            loaded = [i for i, o in enumerate(outcomes) if o.status is BlockStatus.LOADED]
            for i, outcome in enumerate(outcomes):
                if outcome.status is not BlockStatus.LOADED:
                    await self._tracker.settle(tasks[i].job, ((tasks[i], _as_failure(outcome)),))
            if not loaded:
                release_values(batch, self._pool, self._direct)
                return None
            batch.tasks = [tasks[i] for i in loaded]
            batch.views = [batch.views[i] for i in loaded]
            return batch
        except BaseException:
            release_values(batch, self._pool, self._direct)
            raise

    async def _get(self, tasks: list[BlockTask]) -> tuple[StagedBatch, list[KeyOutcome]]:
        slot = await self._pool.take("load")
        views = list(slot.rows(len(tasks), tasks[0].geometry.stored_bytes).unbind(0))
        batch = StagedBatch(tasks, views, slot=slot)
        try:
            outcomes = await self._store.get_into([task.key for task in tasks], views)
        except StoreError as exc:
            outcomes = [store_error_outcome(exc, saving=False)] * len(tasks)
            withhold_if_abandoned(batch, self._pool, exc)
        except BaseException:
            self._pool.release(slot)
            raise
        return batch, outcomes

    async def _lease(self, tasks: list[BlockTask]) -> tuple[StagedBatch, list[KeyOutcome]]:
        assert self._direct is not None
        try:
            extents = await self._direct.lease(
                [task.key for task in tasks], tasks[0].geometry.stored_bytes
            )
        except StoreError as exc:
            extents = Extents([None] * len(tasks),
                              [store_error_outcome(exc, saving=False)] * len(tasks), [])
        # Views of keys not leased are placeholders: their outcome is never LOADED.
        placeholder = torch.empty(0, dtype=torch.uint8)
        views = [placeholder if view is None else view for view in extents.views]
        return StagedBatch(tasks, views, extents=extents), list(extents.outcomes)


def _as_failure(outcome: KeyOutcome) -> KeyOutcome:
    if outcome.status is BlockStatus.FAILED:
        return outcome
    return KeyOutcome(BlockStatus.FAILED, outcome.reason or str(outcome.status))
