"""The log writer: lines are written by a thread of its own, in order, none lost."""

from __future__ import annotations

import io
import time

from pipeline.app.logs import WRITE_INTERVAL_S, _LineWriter


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
