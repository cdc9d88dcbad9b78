"""Completion: turn a finished job into the reply its engine is waiting for."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pipeline.hitrule import longest_hit
from pipeline.jobs import Job, JobTracker
from pipeline.messages import Load, LoadDone, SaveDone, SidecarMessage
from pipeline.sessions import EngineSession
from pipeline.store import BlockStatus

__all__ = ["CompletionStage", "Observe", "Reply", "completion_message"]

Reply = Callable[[EngineSession, SidecarMessage], Awaitable[None]]
Observe = Callable[[SidecarMessage, float], None]
"""Told of each reply sent and when its request was received (for metrics)."""


def completion_message(job: Job) -> SaveDone | LoadDone:
    """The reply for a finished job: per-block outcomes, and for loads what may be used."""
    message = job.message
    reports = tuple(sorted(job.reports, key=lambda r: (r.group_id, r.block_index)))
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
        loaded_tokens = longest_hit(
            layout, message.num_tokens, lambda group, block: (group, block) in loaded
        )
    invalid = tuple(r.block_id for r in reports if r.status is not BlockStatus.LOADED)
    return LoadDone(message.seq, message.request_id, loaded_tokens, invalid, reports)


class CompletionStage:
    def __init__(self, reply: Reply, tracker: JobTracker, observe: Observe | None = None) -> None:
        self._reply = reply
        self._tracker = tracker
        self._observe = observe

    async def process(self, job: Job) -> None:
        message = completion_message(job)
        self._tracker.answered(job)  # before the reply, which reports what is still open
        await self._reply(job.session, message)
        if self._observe is not None:
            self._observe(message, job.received_at)
