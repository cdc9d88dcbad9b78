"""structlog, configured once: JSON when stderr is not a terminal, readable otherwise."""

from __future__ import annotations

import logging
import sys

import structlog

from pipeline.core.config import LoggingConfig

__all__ = ["configure_logging"]


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
