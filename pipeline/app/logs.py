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
import datetime
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


_request_lines: _LineWriter | None = None
"""Where ``log_request`` writes its JSON lines itself, or None: through structlog."""


def configure_logging(config: LoggingConfig) -> None:
    """structlog for every line: JSON, or readable on a terminal. Context is bound to
    loggers (``bind``: per engine), never to context variables.

    In JSON, at info or finer, ``request.done`` lines skip structlog's chain and are
    rendered straight, the same keys in the same order: one comes with every request,
    and the chain costs the event loop about twice as much as the line itself."""
    global _request_lines
    json_output = config.format == "json" or (config.format == "auto" and not sys.stderr.isatty())
    level = logging.getLevelNamesMapping()[config.level.upper()]
    renderer: structlog.typing.Processor
    factory: Callable[..., Any]
    _request_lines = None
    if json_output:
        renderer = structlog.processors.JSONRenderer(serializer=_render_json)
        writer = _LineWriter(sys.stderr.buffer)
        # It writes and flushes, which is all BytesLogger asks of a file.
        factory = structlog.BytesLoggerFactory(file=cast(BinaryIO, writer))
        if level <= logging.INFO:
            _request_lines = writer
    else:
        renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


def _timestamp() -> str:
    """Now, as structlog's ``TimeStamper(fmt="iso", utc=True)`` spells it."""
    return datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")


def log_request(reply: Reply, outcomes: Outcomes, sent_at: float) -> None:
    """One line per completed request (``request.done``): what it asked, what came of it
    (``outcomes``: ``outcome_counts`` of its blocks), when each stage finished its part,
    and when its reply was handed to the socket (``sent_at``, ``time.monotonic``), in ms
    after it was received."""
    request, message = reply.request, reply.message
    start = request.received_at
    fields: dict[str, object] = {
        "kind": request.message.__struct_config__.tag,
        "seq": request.message.seq,
        "tokens": prompt_length(request.message),
        "ms": round((sent_at - start) * 1000, 3),
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
    lines = _request_lines
    if lines is None:
        reply.session.log.info("request.done", request_id=request_id, **fields)
        return
    # As structlog would render it: bound context, the call's fields, then its own.
    line = {**structlog.get_context(reply.session.log), "request_id": request_id, **fields,
            "event": "request.done", "level": "info", "timestamp": _timestamp()}
    lines.write(_json.encode(line) + b"\n")
