"""Batching: one session's blocks of one store group to a batch, as many as one value
slot holds (and ``max_blocks``). The runner regroups the items (``run_batcher``)."""

from __future__ import annotations

from collections.abc import Hashable

from pipeline.core.config import BatchingStageConfig
from pipeline.state.jobs import BlockTask, TaskBatch

__all__ = ["BatchingStage"]


class BatchingStage:
    def __init__(self, config: BatchingStageConfig, slot_bytes: int) -> None:
        self.deadline_s = config.deadline_ms / 1000
        self._max_blocks = config.max_blocks
        self._slot_bytes = slot_bytes

    def group_of(self, task: BlockTask) -> Hashable:
        return id(task.job.session), task.store_group

    def limit_of(self, task: BlockTask) -> int:
        if task.job.done:  # answered: its geometry may be gone; the transfer drops it
            return self._max_blocks
        by_bytes = self._slot_bytes // task.geometry.stored_bytes
        return max(1, min(self._max_blocks, by_bytes))

    def new_batch(self) -> TaskBatch:
        return TaskBatch()
