"""Group filter: only prefix-cacheable groups reach hashing; null blocks never move.

Saves keep every non-null block of every stored group. Loads keep the blocks each
stored group needs to resume at ``num_tokens`` (the hit rule), nothing more.
"""

from __future__ import annotations

from pipeline.state.jobs import Job, JobTracker, planned_blocks

__all__ = ["GroupFilterStage"]


class GroupFilterStage:
    def __init__(self, tracker: JobTracker) -> None:
        self._tracker = tracker

    async def process(self, job: Job) -> Job | None:
        if job.done:  # stopped (cancelled) while it waited here
            return None
        tasks = planned_blocks(job)
        self._tracker.plan(job, tasks)
        if not tasks:
            await self._tracker.settle(job, ())
            return None
        return job
