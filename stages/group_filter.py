"""Group filter: only prefix-cacheable groups reach hashing; null blocks never move.

Saves keep every non-null block of every stored group. Loads keep the blocks each
stored group needs to resume at ``num_tokens`` (the hit rule), nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.hitrule import required_blocks
from pipeline.jobs import BlockTask, Job, JobTracker
from pipeline.layout import NULL_BLOCK_ID
from pipeline.messages import Load

__all__ = ["GroupFilterStage", "plan_tasks"]


def plan_tasks(job: Job) -> list[BlockTask]:
    """The blocks a job moves: per store group, in block order, null blocks left out."""
    session = job.session
    projected = session.layout.project_block_ids(job.message.block_ids)
    tasks: list[BlockTask] = []
    for store_group, block_ids in enumerate(projected):
        if isinstance(job.message, Load):
            group = session.store_groups[store_group].group
            wanted = required_blocks(group, job.message.num_tokens) or range(0)
            indices: Iterable[int] = (j for j in wanted if j < len(block_ids))
        else:
            indices = range(len(block_ids))
        tasks.extend(
            BlockTask(job, store_group, j, block_ids[j])
            for j in indices
            if block_ids[j] != NULL_BLOCK_ID
        )
    return tasks


class GroupFilterStage:
    def __init__(self, tracker: JobTracker) -> None:
        self._tracker = tracker

    async def process(self, job: Job) -> Job | None:
        tasks = plan_tasks(job)
        self._tracker.plan(job, tasks)
        if not tasks:
            await self._tracker.settle(job, ())
            return None
        return job
