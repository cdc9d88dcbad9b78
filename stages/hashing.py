"""Hashing: name every block by its store key, reusing a growing request's hashes.

Blocks past the last full hash block cannot be named yet: saves skip them.
"""

from __future__ import annotations

import anyio

from pipeline.core.hashing import hashed_inline
from pipeline.core.outcomes import BlockStatus, KeyOutcome
from pipeline.state.jobs import Job, JobTracker, TaskBatch

__all__ = ["HashingStage"]

INCOMPLETE = KeyOutcome(BlockStatus.SKIPPED, "incomplete_block")


class HashingStage:
    def __init__(self, tracker: JobTracker, limiter: anyio.CapacityLimiter) -> None:
        self._tracker = tracker
        self._limiter = limiter

    async def process(self, job: Job) -> TaskBatch | None:
        if job.done:  # stopped while it waited here
            return None
        message = job.message
        session = job.session
        if message.block_hashes is not None:
            fine = list(message.block_hashes)  # checked against the tokens at receive
        elif hashed_inline(len(message.token_ids), message.keys):
            fine = session.fine_hashes(message.token_ids, message.keys, message.request_id)
        else:
            fine = await anyio.to_thread.run_sync(
                session.fine_hashes, message.token_ids, message.keys, message.request_id,
                limiter=self._limiter,
            )
        hashes = [session.group_hashes(g, fine) for g in range(len(session.store_groups))]
        keys = [session.speller.keys(geometry.key_prefix, group_hashes)
                for geometry, group_hashes in zip(session.store_groups, hashes, strict=True)]
        named, unnamed = TaskBatch(), []
        for task in job.planned:
            j = task.block_index
            if j < len(keys[task.store_group]):
                task.key = keys[task.store_group][j]
                task.block_hash = hashes[task.store_group][j]
                task.parent_hash = hashes[task.store_group][j - 1] if j else None
                named.append(task)
            else:
                unnamed.append(task)
        if unnamed:
            await self._tracker.settle(job, [(t, INCOMPLETE) for t in unnamed])
        return named or None
