"""Replies to engines: every one stamped with the sidecar's epoch, counted, logged as one
``request.done`` line, and carrying the engine's save credits where it says them.

Saves refused as overloaded are logged as one ``saves.refused`` line per engine per
second (``log_refusals``), not a line each: under a flood the lines would cost the loop
more than the refusals."""

from __future__ import annotations

import collections
import time
from typing import Any, Protocol

import msgspec
import structlog

from pipeline.app.logs import log_request
from pipeline.app.metrics import Metrics
from pipeline.core.config import Config
from pipeline.core.layout import NULL_BLOCK_ID
from pipeline.core.messages import (
    MAX_TEXT,
    Cancelled,
    ErrorReply,
    LoadDone,
    LookupReply,
    Save,
    SaveDone,
    SidecarMessage,
    encode,
    outcome_counts,
)
from pipeline.core.outcomes import INTERNAL, OVERLOADED
from pipeline.state.admission import Admission
from pipeline.state.jobs import Job, Reply, planned_blocks
from pipeline.state.sessions import EngineSession
from transport.server import SidecarSocket

__all__ = ["Replies", "Rooms", "failed_completion"]

log = structlog.get_logger("kvsidecar.service")


class Rooms(Protocol):
    def room(self, path: str, /) -> int:
        """How many more requests ``path`` takes now without waiting."""
        ...


class Replies:
    """The sink every path answers engines through."""

    def __init__(self, config: Config, socket: SidecarSocket, metrics: Metrics,
                 admission: Admission[Any], paths: Rooms, epoch: int) -> None:
        self._config = config
        self._socket = socket
        self._metrics = metrics
        self.admission = admission
        self._paths = paths
        self._epoch = epoch

    def log_refusals(self) -> None:
        """Log how many saves each engine had refused as overloaded since the last call."""
        for engine_id, count in self.admission.refusals():
            log.info("saves.refused", engine_id=engine_id, saves=count,
                     reason=OVERLOADED.reason)

    async def send_reply(self, reply: Reply, *, line: bool = True) -> None:
        """The sink of every path that answers engines; ``line``: log its request."""
        message = reply.message
        if isinstance(message, LookupReply | SaveDone):
            message = msgspec.structs.replace(
                message, save_credits=self.save_credits(reply.session)
            )
        # Timed as handed to the socket: a send that wakes ZMQ's I/O thread may see this
        # thread preempted by it for a while, as it sends the reply.
        sent_at = time.monotonic()
        self.send(reply.to, message)
        if isinstance(reply.request, Job):
            if 0 < reply.request.deadline < sent_at:
                self._metrics.late.inc()
            if reply.request.cancels:
                self.answer_cancels(reply.request)
        reply = Reply(reply.session, message, reply.request)
        outcomes = outcome_counts(message.blocks) if isinstance(
            message, SaveDone | LoadDone) else collections.Counter()
        self._metrics.replied(reply, outcomes, sent_at)
        if line and self._config.logging.requests:
            log_request(reply, outcomes, sent_at)

    def save_credits(self, session: EngineSession) -> int:
        """How many more saves of this engine would be taken now (-1: never refused)."""
        return self.admission.credits(saves_in_flight=session.saves_in_flight,
                                      room=self._paths.room("save"))

    def send(self, identity: bytes, message: SidecarMessage) -> None:
        self._socket.send(identity, encode(msgspec.structs.replace(message, epoch=self._epoch)))

    def answer_cancels(self, job: Job) -> None:
        """Answer the engine's cancels of ``job``, now answered itself."""
        for seq in job.cancels:
            self.send(job.session.identity, Cancelled(seq, job.message.seq))
        job.cancels.clear()

    def send_error(self, identity: bytes, code: str, error: str, seq: int = 0) -> None:
        """An error reply; its text cut to what the wire takes."""
        if len(error) > MAX_TEXT:
            error = error[: MAX_TEXT - 3] + "..."
        self.send(identity, ErrorReply(code, error, seq))


def failed_completion(job: Job) -> SaveDone | LoadDone:
    """The completion of a job that failed as a whole: every block it would move failed,
    and for a load nothing loaded past what the engine held (every block it would write
    is listed, so that the engine never reads one)."""
    if job.reports:  # settled in part, the rest failed (``JobTracker.abandon``)
        reports = tuple(job.reports)
    else:
        tasks = job.planned or planned_blocks(job)
        reports = tuple(job.report(task, INTERNAL) for task in tasks)
    message = job.message
    if isinstance(message, Save):
        return SaveDone(message.seq, message.request_id, reports)
    projected = job.session.layout.project_block_ids(message.block_ids)
    invalid = sorted({block for ids in projected for block in ids if block != NULL_BLOCK_ID})
    return LoadDone(message.seq, message.request_id, message.computed_tokens,
                    tuple(invalid), reports)
