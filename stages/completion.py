"""Completion: turn a finished job into the reply its engine is waiting for."""

from __future__ import annotations

import operator

from pipeline.core.hitrule import longest_hit
from pipeline.core.messages import Load, LoadDone, SaveDone
from pipeline.core.outcomes import BlockStatus
from pipeline.state.jobs import Job, JobTracker, Reply

__all__ = ["CompletionStage", "completion_message"]

_BLOCK_ORDER = operator.attrgetter("group_id", "block_index")


def completion_message(job: Job) -> SaveDone | LoadDone:
    """The reply for a finished job: per-block outcomes, and for loads what may be used."""
    message = job.message
    reports = tuple(sorted(job.reports, key=_BLOCK_ORDER))
    if not isinstance(message, Load):
        return SaveDone(message.seq, message.request_id, reports)
    layout = job.session.layout
    loaded = {
        (layout.store_group_index(r.group_id), r.block_index)
        for r in reports
        if r.status is BlockStatus.LOADED
    }
    loaded_tokens = message.num_tokens
    if len(loaded) < len(reports):
        # Resume only where every stored group has what it needs; the engine recomputes
        # from there (the failed blocks are listed so it never reads them).
        held = [message.computed_tokens // group.block_size for group in layout.store_groups]
        loaded_tokens = longest_hit(
            layout,
            message.num_tokens,
            lambda group, block: block < held[group] or (group, block) in loaded,
        )
    invalid = tuple(r.block_id for r in reports if r.status is not BlockStatus.LOADED)
    return LoadDone(message.seq, message.request_id, loaded_tokens, invalid, reports)


class CompletionStage:
    def __init__(self, tracker: JobTracker) -> None:
        self._tracker = tracker

    async def process(self, job: Job) -> Reply:
        self._tracker.answered(job)  # before the reply, which reports what is still open
        return Reply(job.session, completion_message(job), job)
