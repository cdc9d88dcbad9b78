"""Memory handed over by its owner: descriptors passed with ``SCM_RIGHTS``, never named.

An engine shares CPU memory by passing the sidecar its own descriptors of it. The
exchange is tied to the engine's authenticated session:

1. On its ZMQ connection (``ipc://``: the kernel has told the sidecar the peer's pid and
   uid), the engine asks for a ticket (``Handover``); the sidecar answers with a random
   one-time token and the path of its handover socket (``HandoverTicket``).
2. The engine connects to that unix socket and sends the token with its descriptors
   (``SCM_RIGHTS``, at most ``FDS_PER_MESSAGE`` a connection: a larger set goes over
   several). The sidecar takes them only from the very process the ticket was issued to:
   the handover connection's peer credentials (``SO_PEERCRED``: pid and uid) must match
   the ZMQ connection's. Each must be a regular file.
3. The engine registers naming the token; each CPU tensor names its file by index. The
   registration claims the ticket, on the same connection: a token is good once, on the
   connection it was issued to, for ``TICKET_TTL_S``.

A descriptor that was passed is the owner's own: nothing a peer writes (a pid, a path, a
name) is ever opened, and sizes come from ``fstat``. Descriptors held for tickets not yet
claimed are bounded in total (``HandoverDesk.max_fds``); refusals say what the engine
did wrong with its own ticket or files, never anything about another process.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import secrets
import socket
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc
import structlog

from pipeline.core.errors import LimitExceeded, RequestRejected, TransportError
from pipeline.core.messages import MAX_SEGMENTS, TICKET_BYTES, ErrorCode
from pipeline.core.tenancy import Peer

__all__ = [
    "FDS_PER_MESSAGE",
    "MAX_SEGMENTS",
    "Handed",
    "HandoverDesk",
    "hand_over",
]

log = structlog.get_logger("kvsidecar.handover")

TICKET_TTL_S = 30.0
"""How long a ticket waits for its descriptors and its registration."""
HANDOVER_TIMEOUT_S = 2.0
"""How long one handover connection may take to send its token and descriptors."""
MAX_HANDOVERS_AT_ONCE = 16
"""Handover connections served at once; more are closed at once (the engine retries)."""
MAX_TICKETS = 1024
"""Tickets outstanding at once (one per connection at most)."""
FDS_PER_MESSAGE = 253
"""The most descriptors the kernel passes in one message (``SCM_MAX_FD``)."""
_OK, _REFUSED = b"\x00", b"\x01"
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


# -- engine side ----------------------------------------------------------------------


def hand_over(path: str, token: bytes, fds: Sequence[int], *, timeout_s: float = 10.0) -> None:
    """Pass ``fds`` to the sidecar's handover socket at ``path`` with a ticket's
    ``token`` (blocking). Raises ``TransportError`` with the sidecar's reason."""
    for start in range(0, max(len(fds), 1), FDS_PER_MESSAGE):
        chunk = list(fds[start:start + FDS_PER_MESSAGE])
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(timeout_s)
                connection.connect(path)
                socket.send_fds(connection, [token], chunk)
                reply = connection.recv(1024)
        except OSError as exc:
            raise TransportError(f"cannot hand memory over to the sidecar: {exc}") from exc
        if reply[:1] != _OK:
            reason = reply[1:].decode(errors="replace") or "the connection was closed"
            raise TransportError(f"the sidecar refused the memory handover: {reason}")


# -- sidecar side ---------------------------------------------------------------------


@dataclass(eq=False)
class Handed:
    """Descriptors one engine process handed over, in order, and a pidfd of that
    process. Whoever holds it closes it (``close``), or takes single descriptors out
    (``take``)."""

    pid: int
    pidfd: int
    fds: list[int] = field(default_factory=list)

    def take(self, index: int) -> int:
        """Descriptor ``index``, now the caller's to close; -1 if there is none (out of
        range, or taken)."""
        if not 0 <= index < len(self.fds):
            return -1
        fd, self.fds[index] = self.fds[index], -1
        return fd

    def close(self) -> None:
        """Close every descriptor not taken, and the pidfd; idempotent."""
        fds, self.fds = self.fds, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


@dataclass(eq=False)
class _Ticket:
    connection: bytes
    peer: Peer
    expires: float
    handed: Handed | None = None

    def close(self) -> None:
        if self.handed is not None:
            self.handed.close()


class _Refused(Exception):
    """A handover refused; the message is the engine's to read."""


class HandoverDesk:
    """Issues tickets on authenticated connections and takes the descriptors handed over
    with them (see the module's docstring). ``run`` serves the handover socket."""

    def __init__(self, path: Path, *, permissions: int = 0o600,
                 max_fds: int | None = None) -> None:
        """``path``: where the handover socket is bound (its directory must keep out
        whoever should not connect; the token and peer credentials keep out the rest).
        ``max_fds``: descriptors held for unclaimed tickets at most (None: half of what
        the process may open)."""
        self.path = path
        self.max_fds = max_fds if max_fds is not None else _descriptor_budget()
        self._tickets: dict[bytes, _Ticket] = {}
        self._by_connection: dict[bytes, bytes] = {}
        self._held = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path.unlink(missing_ok=True)
            old_umask = os.umask(0o777 & ~permissions)
            try:
                self._listener.bind(str(path))
            finally:
                os.umask(old_umask)
            self._listener.listen(MAX_HANDOVERS_AT_ONCE)
            self._listener.setblocking(False)
        except OSError as exc:
            self._listener.close()
            raise TransportError(f"cannot bind the handover socket {path}: {exc}") from exc
        self._limiter = anyio.CapacityLimiter(MAX_HANDOVERS_AT_ONCE)

    def issue(self, connection: bytes, peer: Peer) -> bytes:
        """A new ticket for ``connection`` (replacing any it had), for the process the
        transport says is behind it."""
        if peer.pid is None or peer.uid is None:
            raise RequestRejected(
                ErrorCode.BAD_TENSORS,
                "CPU memory is handed over on the sidecar's host, by a peer on its ipc:// "
                "endpoint; this connection is not one")
        self._expire()
        self._drop(self._by_connection.pop(connection, b""))
        if len(self._tickets) >= MAX_TICKETS:
            raise LimitExceeded("handover.tickets", "too many memory handovers are pending; "
                                "retry shortly")
        token = secrets.token_bytes(TICKET_BYTES)
        self._tickets[token] = _Ticket(connection, peer, time.monotonic() + TICKET_TTL_S)
        self._by_connection[connection] = token
        return token

    def claim(self, token: bytes, connection: bytes, peer: Peer) -> Handed:
        """The descriptors handed over with ``token``, now the caller's: only on the
        connection, and for the peer, the ticket was issued to, once."""
        self._expire()
        ticket = self._tickets.get(token)
        if (ticket is None or ticket.connection != connection or ticket.peer != peer
                or ticket.handed is None):
            raise RequestRejected(
                ErrorCode.BAD_TENSORS,
                "no memory was handed over with this registration's token on this "
                "connection (ask for a ticket, pass the descriptors, then register)")
        del self._tickets[token]
        self._by_connection.pop(connection, None)
        self._held -= len(ticket.handed.fds)
        return ticket.handed

    async def run(self) -> None:
        """Serve the handover socket until cancelled."""
        async with anyio.create_task_group() as group:
            while True:
                await anyio.wait_readable(self._listener)
                try:
                    connection, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    # Out of descriptors, most likely: the engine is told by the close.
                    log.warning("handover.accept.failed", error=str(exc))
                    await anyio.sleep(0.01)
                    continue
                if self._limiter.available_tokens < 1:
                    connection.close()
                    continue
                group.start_soon(self._serve, connection)

    async def _serve(self, connection: socket.socket) -> None:
        async with self._limiter:
            with connection:
                connection.setblocking(False)
                try:
                    with anyio.fail_after(HANDOVER_TIMEOUT_S):
                        await self._take(connection)
                except _Refused as exc:
                    log.info("handover.refused", reason=str(exc))
                    _reply(connection, _REFUSED + str(exc).encode())
                except TimeoutError:
                    log.info("handover.refused", reason="too slow")
                else:
                    _reply(connection, _OK)

    async def _take(self, connection: socket.socket) -> None:
        pid, uid, _ = _CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
        while True:
            await anyio.wait_readable(connection)
            try:
                message, fds, flags, _ = socket.recv_fds(
                    connection, TICKET_BYTES, FDS_PER_MESSAGE, socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _Refused(f"cannot receive: {exc.strerror}") from exc
            break
        try:
            ticket = self._tickets.get(message)
            if (ticket is None or ticket.expires < time.monotonic()
                    or (ticket.peer.pid, ticket.peer.uid) != (pid, uid)):
                raise _Refused("no ticket of this process has this token")
            if flags & socket.MSG_CTRUNC or not fds:
                raise _Refused(f"pass between 1 and {FDS_PER_MESSAGE} descriptors a "
                               "connection")
            held = 0 if ticket.handed is None else len(ticket.handed.fds)
            if held + len(fds) > MAX_SEGMENTS:
                raise LimitExceeded("segments_per_engine",
                                    f"an engine hands over at most {MAX_SEGMENTS} memory files")
            if self._held + len(fds) > self.max_fds:
                raise _Refused("too many descriptors are being handed over; retry shortly")
            for fd in fds:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise _Refused("a descriptor passed is not a memory file")
            if ticket.handed is None:
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError as exc:
                    raise _Refused("the process has exited") from exc
                ticket.handed = Handed(pid, pidfd)
        except LimitExceeded as exc:
            _close_all(fds)
            raise _Refused(str(exc)) from exc
        except BaseException:
            _close_all(fds)
            raise
        ticket.handed.fds.extend(fds)
        self._held += len(fds)

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, ticket in self._tickets.items() if ticket.expires < now]:
            self._by_connection.pop(self._tickets[token].connection, None)
            self._drop(token)

    def _drop(self, token: bytes) -> None:
        ticket = self._tickets.pop(token, None)
        if ticket is not None:
            if ticket.handed is not None:
                self._held -= len(ticket.handed.fds)
            ticket.close()

    def close(self) -> None:
        for token in list(self._tickets):
            self._drop(token)
        self._by_connection.clear()
        self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def __enter__(self) -> HandoverDesk:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _reply(connection: socket.socket, reply: bytes) -> None:
    with contextlib.suppress(OSError):  # an engine that left does not hear it
        connection.send(reply[:1024])


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def _descriptor_budget() -> int:
    """Half the descriptors this process may open, the soft limit raised to the hard
    one first: the rest are the sockets' and the store's."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(MAX_SEGMENTS, math.floor(soft / 2))
