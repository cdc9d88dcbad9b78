"""The sidecar's ZMQ ROUTER endpoint: frames in, replies out, with explicit bounds.

High-water marks are set explicitly (never 0 = unbounded) so a sidecar that stops
reading pushes back on engines; ROUTER_MANDATORY makes a reply to a vanished engine an
error we can log instead of a silent drop. ipc:// sockets are owner-only by default.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from types import TracebackType

import structlog
import zmq
import zmq.asyncio

from pipeline.config import ServerConfig
from pipeline.errors import TransportError

__all__ = ["SidecarSocket", "open_server_socket"]

log = structlog.get_logger("kvsidecar.server")


def _check_endpoint(config: ServerConfig) -> None:
    endpoint = config.endpoint
    scheme = endpoint.split("://", 1)[0]
    if scheme not in ("ipc", "tcp"):
        raise TransportError(f"endpoint {endpoint!r}: only ipc:// and tcp:// are supported")
    if scheme == "tcp":
        host = urllib.parse.urlsplit(endpoint).hostname or ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback and not config.allow_insecure_tcp:
            raise TransportError(
                f"endpoint {endpoint!r} listens beyond loopback without authentication; "
                "set server.allow_insecure_tcp: true to allow it"
            )


class SidecarSocket:
    """A bound ROUTER socket; ``receive`` yields (engine identity, frame)."""

    def __init__(self, config: ServerConfig) -> None:
        _check_endpoint(config)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.RCVHWM, config.rcvhwm)
        self._socket.setsockopt(zmq.SNDHWM, config.sndhwm)
        # Frames over max_frame_bytes get an error reply; far larger ones cut the peer off.
        self._socket.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_frame_bytes)
        self._ipc_path: str | None = None
        try:
            if config.endpoint.startswith("ipc://"):
                path = config.endpoint.removeprefix("ipc://")
                # Create the socket file owner-only from the start, not chmod'ed later.
                old_umask = os.umask(0o777 & ~config.ipc_permissions)
                try:
                    self._socket.bind(config.endpoint)
                finally:
                    os.umask(old_umask)
                self._ipc_path = path
            else:
                self._socket.bind(config.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            self._context.term()
            raise TransportError(f"cannot bind {config.endpoint}: {exc}") from exc
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    async def receive(self) -> tuple[bytes, bytes]:
        parts = await self._socket.recv_multipart(copy=True)
        if len(parts) != 2:
            # A ROUTER always prepends the identity; engines send exactly one frame.
            return parts[0], b"".join(parts[1:]) if len(parts) > 2 else b""
        return parts[0], parts[1]

    async def send(self, identity: bytes, frame: bytes) -> bool:
        """Send one frame to an engine; False if the engine is gone."""
        try:
            await self._socket.send_multipart([identity, frame])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                log.info("server.send.unreachable", identity=identity.hex())
                return False
            raise TransportError(f"send failed: {exc}") from exc
        return True

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()
        if self._ipc_path and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)

    def __enter__(self) -> SidecarSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_server_socket(config: ServerConfig) -> SidecarSocket:
    return SidecarSocket(config)
