"""The log writer: lines are written by a thread of its own, in order, none lost."""

from __future__ import annotations

import collections
import io
import json
import sys
import time
import types

import pytest
import structlog

from pipeline.app import logs
from pipeline.app.logs import WRITE_INTERVAL_S, _LineWriter
from pipeline.core.config import LoggingConfig
from pipeline.core.messages import Save, SaveDone, pack_tokens
from pipeline.core.outcomes import BlockStatus
from pipeline.state.jobs import Job, Reply


class Out(io.BytesIO):
    """A binary file that counts its writes."""

    writes = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        return super().write(data)


def test_lines_are_written_in_order_in_few_writes_and_all_of_them_at_close() -> None:
    out = Out()
    writer = _LineWriter(out)
    for i in range(2000):
        writer.write(b"%d\n" % i)
    deadline = time.monotonic() + 100 * WRITE_INTERVAL_S
    while out.getvalue().count(b"\n") < 2000 and time.monotonic() < deadline:
        time.sleep(WRITE_INTERVAL_S)
    assert out.getvalue() == b"".join(b"%d\n" % i for i in range(2000))  # without a close
    assert out.writes < 100  # lines queued meanwhile go out together
    writer.write(b"last\n")
    writer.close()  # what is still queued is written before it returns
    assert out.getvalue().endswith(b"1999\nlast\n")


class Stderr:
    """A stderr that is not a terminal, its bytes in ``buffer``."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()

    def isatty(self) -> bool:
        return False


def test_request_lines_rendered_straight_read_as_structlogs_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request.done line skips structlog's processors only to come out the same: the
    engine's bound fields, the line's own, then event, level and timestamp, in that
    order, with the same values."""
    stderr = Stderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        logs.configure_logging(LoggingConfig(level="info", format="auto"))
        writer = logs._request_lines
        assert writer is not None
        session = types.SimpleNamespace(
            log=structlog.get_logger("kvsidecar.requests").bind(engine_id="engine-1"))
        save = Save(7, "req-1", pack_tokens(range(32)), ((1, 2),))
        job = Job(session, save)  # type: ignore[arg-type]
        job.marks.update({"save.hashing": job.received_at + 0.0001,
                          "save.transfer": job.received_at + 0.002})
        reply = Reply(session, SaveDone(7, "req-1", ()), job)  # type: ignore[arg-type]
        outcomes = collections.Counter({(BlockStatus.STORED, ""): 2})
        sent_at = job.received_at + 0.003
        logs.log_request(reply, outcomes, sent_at)
        monkeypatch.setattr(logs, "_request_lines", None)  # through structlog's chain
        logs.log_request(reply, outcomes, sent_at)
        writer.close()
    finally:
        structlog.reset_defaults()
    straight, chained = (json.loads(line) for line in stderr.buffer.getvalue().splitlines())
    assert list(straight) == list(chained) == [
        "engine_id", "request_id", "kind", "seq", "tokens", "ms", "stages", "blocks",
        "event", "level", "timestamp"]
    assert {**straight, "timestamp": ""} == {**chained, "timestamp": ""}
    assert straight["ms"] == 3.0
    assert straight["timestamp"].endswith("Z") and straight["timestamp"] <= chained["timestamp"]
    assert straight["stages"] == {"hashing": 0.1, "transfer": 2.0}


def test_request_lines_go_through_structlog_when_info_is_off() -> None:
    """Above info, or on a terminal, no line is rendered straight: structlog filters
    and formats every one."""
    try:
        logs.configure_logging(LoggingConfig(level="warning", format="json"))
        assert logs._request_lines is None
        logs.configure_logging(LoggingConfig(level="info", format="console"))
        assert logs._request_lines is None
    finally:
        structlog.reset_defaults()
