"""Dedup: blocks already in the store are reported present and never copied again."""

from __future__ import annotations

from pipeline.errors import StoreError
from pipeline.jobs import BlockTask, JobTracker
from pipeline.store import PRESENT, KVStore, store_error_outcome

__all__ = ["DedupStage"]


class DedupStage:
    def __init__(self, store: KVStore, tracker: JobTracker) -> None:
        self._store = store
        self._tracker = tracker

    async def process(self, tasks: list[BlockTask]) -> list[BlockTask] | None:
        """``tasks`` are one job's named blocks; returns those the store lacks."""
        try:
            exists = await self._store.exists([task.key for task in tasks])
        except StoreError as exc:
            await self._tracker.settle_all(tasks, store_error_outcome(exc, saving=True))
            return None
        present = [task for task, hit in zip(tasks, exists, strict=True) if hit]
        missing = [task for task, hit in zip(tasks, exists, strict=True) if not hit]
        if present:
            await self._tracker.settle_all(present, PRESENT)
        return missing or None
