"""A real sidecar process for testing code that talks to one (an engine's integration).

    with run_sidecar_process({"store": {"embedded": {"capacity_bytes": 1 << 26}}}) as sidecar:
        client = await EngineClient.connect(sidecar.endpoint, layout=..., kv_caches=...)

A sidecar that failed to handle a message of its own fault (``internal``: a bug, which
its guard answered) fails the test that ran it, when the block exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import zmq

from pipeline.app import launcher
from pipeline.app.launcher import SidecarProcess
from pipeline.core.errors import TransportError
from pipeline.core.messages import (
    Handover,
    HandoverTicket,
    Register,
    decode_sidecar_message,
    encode,
)
from transport.handover import hand_over

__all__ = ["INTERNAL_EVENTS", "SidecarProcess", "handed_over", "run_sidecar_process"]

INTERNAL_EVENTS = ("server.request.internal", "stage.item.internal")
"""The log events of a message, or a part of one, the sidecar failed to handle."""


@contextlib.contextmanager
def run_sidecar_process(
    overrides: Mapping[str, Any] | None = None, *, allow_internal: bool = False,
    **kwargs: Any,
) -> Iterator[SidecarProcess]:
    """``pipeline.app.launcher.run_sidecar_process``; on a clean exit of the block the
    sidecar is stopped, and any ``internal`` failure it logged fails the caller, unless
    ``allow_internal`` (a test that injects one)."""
    with launcher.run_sidecar_process(overrides, **kwargs) as sidecar:
        yield sidecar
        if not allow_internal:
            log = sidecar.final_log()
            failures = [line for line in log.splitlines()
                        if any(event in line for event in INTERNAL_EVENTS)]
            assert not failures, (
                f"the sidecar failed to handle {len(failures)} message(s) (internal): "
                + "\n".join(failures[:3]))


def handed_over(socket: zmq.Socket[bytes], register: Register, fds: Sequence[int], *,
                timeout_s: float = 30.0) -> Register:
    """``register`` carrying a fresh ticket's token, once ``fds`` were handed over with it:
    for a test that speaks raw frames on ``socket`` (a DEALER, no reply pending)."""
    socket.send(encode(Handover(0)))
    if not socket.poll(int(timeout_s * 1000)):
        raise TransportError("no handover ticket from the sidecar")
    ticket = decode_sidecar_message(socket.recv())
    if not isinstance(ticket, HandoverTicket):
        raise TransportError(f"no handover ticket from the sidecar: {ticket}")
    hand_over(ticket.path, ticket.token, fds, timeout_s=timeout_s)
    return msgspec.structs.replace(register, handover=ticket.token)
