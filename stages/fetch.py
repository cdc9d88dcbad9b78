"""Fetch: get a batch of blocks from the store into a staging slot.

Only blocks the store reports loaded travel on to the scatter; the others settle here
as failed, so the engine recomputes them and never sees undefined bytes.
"""

from __future__ import annotations

import anyio

from pipeline.errors import StoreError
from pipeline.integrity import verify_rows
from pipeline.jobs import BlockTask, JobTracker
from pipeline.staging import StagingPool
from pipeline.store import BlockStatus, KeyOutcome, KVStore, store_error_outcome
from stages.transfer import StagedBatch

__all__ = ["CHECKSUM_MISMATCH", "FetchStage"]

CHECKSUM_MISMATCH = KeyOutcome(BlockStatus.FAILED, "checksum_mismatch")


class FetchStage:
    def __init__(
        self,
        store: KVStore,
        pool: StagingPool,
        tracker: JobTracker,
        limiter: anyio.CapacityLimiter,
    ) -> None:
        self._store = store
        self._pool = pool
        self._tracker = tracker
        self._limiter = limiter

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        slot = await self._pool.take("load")
        try:
            geometry = tasks[0].geometry
            rows = slot.rows(len(tasks), geometry.stored_bytes)
            try:
                outcomes = await self._store.get_into(
                    [task.key for task in tasks], list(rows.unbind(0))
                )
            except StoreError as exc:
                outcomes = [store_error_outcome(exc, saving=False)] * len(tasks)
            if geometry.checksum_seed is not None:
                intact = await anyio.to_thread.run_sync(
                    verify_rows, rows, geometry.value_bytes, geometry.checksum_seed,
                    limiter=self._limiter,
                )
                outcomes = [
                    CHECKSUM_MISMATCH if o.status is BlockStatus.LOADED and not ok else o
                    for o, ok in zip(outcomes, intact, strict=True)
                ]
            loaded = [i for i, o in enumerate(outcomes) if o.status is BlockStatus.LOADED]
            for i, outcome in enumerate(outcomes):
                if outcome.status is not BlockStatus.LOADED:
                    await self._tracker.settle(
                        tasks[i].job, ((tasks[i], _as_failure(outcome)),)
                    )
            if not loaded:
                self._pool.release(slot)
                return None
            if len(loaded) < len(tasks):
                # Keep loaded rows at the front so the scatter sees one dense matrix.
                kept = rows[loaded].clone()
                rows = rows[: len(loaded)]
                rows.copy_(kept)
            return StagedBatch([tasks[i] for i in loaded], slot, rows)
        except BaseException:
            self._pool.release(slot)
            raise


def _as_failure(outcome: KeyOutcome) -> KeyOutcome:
    if outcome.status is BlockStatus.FAILED:
        return outcome
    return KeyOutcome(BlockStatus.FAILED, outcome.reason or str(outcome.status))
