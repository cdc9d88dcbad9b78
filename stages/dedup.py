"""Dedup: blocks already in the store are reported present and never copied again.

A key holding a value this engine cannot read (another size, or no checksum where one
is required) is skipped with that reason: never overwritten, never counted present.
"""

from __future__ import annotations

from pipeline.core.errors import StoreError
from pipeline.core.store import PRESENCE_OUTCOMES, KVStore, Presence
from pipeline.state.jobs import JobTracker, TaskBatch, live

__all__ = ["DedupStage"]


class DedupStage:
    def __init__(self, store: KVStore, tracker: JobTracker) -> None:
        self._store = store
        self._tracker = tracker

    async def process(self, tasks: TaskBatch) -> TaskBatch | None:
        """``tasks`` are one job's named blocks; returns those the store lacks."""
        tasks = TaskBatch(live(tasks))
        if not tasks:
            return None
        try:
            found = await self._store.exists(
                [task.key for task in tasks], [task.geometry.stored_bytes for task in tasks]
            )
        except StoreError as exc:
            await tasks.fail(exc, self._tracker)
            return None
        missing = TaskBatch()
        settled, outcomes = [], []
        for task, presence in zip(tasks, found, strict=True):
            if presence is Presence.ABSENT:
                missing.append(task)
            else:
                settled.append(task)
                outcomes.append(PRESENCE_OUTCOMES[presence])
        if settled:
            await self._tracker.settle_each(settled, outcomes)
        return missing or None

