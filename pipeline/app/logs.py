"""structlog, configured once: JSON when stderr is not a terminal, readable otherwise;
and the one canonical line each completed request gets.

JSON lines are rendered by msgspec and written by a thread of their own: the event loop
only queues a line, so logging never makes it wait on a write (a write releases the GIL,
and getting it back behind busy copy threads can take milliseconds), and the thread
writes what has queued every few milliseconds rather than waking for each line.
"""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO, cast

import msgspec
import structlog

from pipeline.app.metrics import Outcomes
from pipeline.core.config import LoggingConfig
from pipeline.core.messages import LoadDone, LookupReply, SaveDone, prompt_length
from pipeline.state.jobs import Reply

__all__ = ["configure_logging", "log_request"]


MAX_QUEUED_LINES = 65536
"""Past this many lines not yet written (stderr blocked), logging waits for the writer."""
WRITE_INTERVAL_S = 0.02
"""How often the writer thread writes out the lines queued meanwhile."""


class _LineWriter:
    """A binary file for structlog's ``BytesLogger``: lines are queued, and a daemon thread
    writes out what has queued every ``WRITE_INTERVAL_S`` (and once more at exit).

    The writer is never woken per line: a wake-up per line costs the loop a context
    switch, and on a small host it takes a core from an engine, for every request."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._lines: collections.deque[bytes] = collections.deque()  # appends are atomic
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvsidecar-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def write(self, line: bytes) -> None:
        while len(self._lines) > MAX_QUEUED_LINES:  # stderr is blocked: wait, as a write would
            time.sleep(0.001)
        self._lines.append(line)

    def flush(self) -> None:
        """Lines are flushed by the writer thread."""

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed.wait(WRITE_INTERVAL_S):
            self._write_queued()
        self._write_queued()

    def _write_queued(self) -> None:
        lines = self._lines
        if lines:
            self._out.write(b"".join([lines.popleft() for _ in range(len(lines))]))
            self._out.flush()


_json = msgspec.json.Encoder(enc_hook=str)


def _render_json(event: object, **_: object) -> bytes:
    return _json.encode(event)


def configure_logging(config: LoggingConfig) -> None:
    json_output = config.format == "json" or (config.format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor
    factory: Callable[..., Any]
    if json_output:
        renderer = structlog.processors.JSONRenderer(serializer=_render_json)
        # It writes and flushes, which is all BytesLogger asks of a file.
        factory = structlog.BytesLoggerFactory(
            file=cast(BinaryIO, _LineWriter(sys.stderr.buffer)))
    else:
        renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[config.level.upper()]
        ),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


def log_request(reply: Reply, outcomes: Outcomes) -> None:
    """One line per completed request (``request.done``): what it asked, what came of it
    (``outcomes``: ``outcome_counts`` of its blocks), and when each stage finished its
    part, in ms after it was received."""
    request, message = reply.request, reply.message
    start = request.received_at
    fields: dict[str, object] = {
        "kind": request.message.__struct_config__.tag,
        "seq": request.message.seq,
        "tokens": prompt_length(request.message),
        "ms": round((time.monotonic() - start) * 1000, 3),
        "stages": {stage.rsplit(".", 1)[-1]: round((at - start) * 1000, 3)
                   for stage, at in request.marks.items()},
    }
    if isinstance(message, LookupReply):
        fields["hit_tokens"] = message.hit_tokens
        if message.explain is not None:
            fields["explained_blocks"] = len(message.explain)
    elif isinstance(message, SaveDone | LoadDone):
        fields["blocks"] = {f"{status}:{reason}" if reason else str(status): count
                            for (status, reason), count in outcomes.items()}
        if isinstance(message, LoadDone):
            fields["loaded_tokens"] = message.loaded_tokens
    request_id = getattr(request.message, "request_id", None)
    reply.session.log.info("request.done", request_id=request_id, **fields)
