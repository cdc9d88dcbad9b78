"""structlog, configured once: JSON when stderr is not a terminal, readable otherwise;
and the one canonical line each completed request gets."""

from __future__ import annotations

import collections
import logging
import sys
import time

import structlog

from pipeline.core.config import LoggingConfig
from pipeline.core.messages import LoadDone, LookupReply, SaveDone
from pipeline.state.jobs import Reply

__all__ = ["configure_logging", "log_request"]


def configure_logging(config: LoggingConfig) -> None:
    json_output = config.format == "json" or (config.format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer()
    )
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def log_request(reply: Reply) -> None:
    """One line per completed request (``request.done``): what it asked, what came of it,
    and when each stage finished its part, in ms after it was received."""
    request, message = reply.request, reply.message
    start = request.received_at
    fields: dict[str, object] = {
        "kind": request.message.__struct_config__.tag,
        "seq": request.message.seq,
        "tokens": len(request.message.token_ids),
        "ms": round((time.monotonic() - start) * 1000, 3),
        "stages": {stage.rsplit(".", 1)[-1]: round((at - start) * 1000, 3)
                   for stage, at in request.marks.items()},
    }
    if isinstance(message, LookupReply):
        fields["hit_tokens"] = message.hit_tokens
        if message.explain is not None:
            fields["explained_blocks"] = len(message.explain)
    elif isinstance(message, SaveDone | LoadDone):
        fields["blocks"] = dict(collections.Counter(
            f"{block.status}:{block.reason.split(':', 1)[0]}" if block.reason
            else str(block.status)
            for block in message.blocks
        ))
        if isinstance(message, LoadDone):
            fields["loaded_tokens"] = message.loaded_tokens
    request_id = getattr(request.message, "request_id", None)
    reply.session.log.info("request.done", request_id=request_id, **fields)
