"""Dedup: blocks already in the store are reported present and never copied again."""

from __future__ import annotations

from pipeline.core.errors import StoreError
from pipeline.core.outcomes import PRESENT
from pipeline.core.store import KVStore
from pipeline.state.jobs import JobTracker, TaskBatch

__all__ = ["DedupStage"]


class DedupStage:
    def __init__(self, store: KVStore, tracker: JobTracker) -> None:
        self._store = store
        self._tracker = tracker

    async def process(self, tasks: TaskBatch) -> TaskBatch | None:
        """``tasks`` are one job's named blocks; returns those the store lacks."""
        try:
            exists = await self._store.exists([task.key for task in tasks])
        except StoreError as exc:
            await tasks.fail(exc, self._tracker)
            return None
        present = [task for task, hit in zip(tasks, exists, strict=True) if hit]
        missing = TaskBatch(task for task, hit in zip(tasks, exists, strict=True) if not hit)
        if present:
            await self._tracker.settle_all(present, PRESENT)
        return missing or None
