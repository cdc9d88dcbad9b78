"""The sidecar's ZMQ ROUTER endpoint: frames in, replies out, with explicit bounds.

High-water marks are set explicitly (never 0 = unbounded) so a sidecar that stops
reading pushes back on engines; ROUTER_MANDATORY makes a reply to a vanished engine an
error we can log instead of a silent drop. ipc:// sockets are owner-only by default,
and the default endpoint lives in the sidecar's own mode-0700 directory.

Every connection's handshake passes the ZAP handler of ``transport.auth``; every
admitted message carries its peer's proven identity. The key-file readers engines use
(``load_key_pair``, ``load_public_key``) are re-exported here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import cast

import structlog
import zmq
import zmq.asyncio
import zmq.utils.z85

from pipeline.core.config import ServerConfig, runtime_dir
from pipeline.core.errors import TransportError
from pipeline.core.private import not_private
from pipeline.core.tenancy import Peer, Tenancy
from transport.auth import (
    MAX_KNOWN_PEERS,
    ZAP_DOMAIN,
    Gatekeeper,
    curve_keys,
    load_key_pair,
    load_public_key,
    peer_credentials,
    read_key_file,
)
from transport.liveness import hold_endpoint
from transport.sockets import FastSocket

__all__ = [
    "SidecarSocket",
    "load_key_pair",
    "load_public_key",
    "open_server_socket",
    "peer_credentials",
    "private_directory",
    "read_key_file",
]

log = structlog.get_logger("kvsidecar.server")

FRAME_SLACK_BYTES = 4096
"""How far past ``server.max_frame_bytes`` a frame is still read (and refused with an
error reply); a larger one closes its sender's connection."""


def _check_endpoint(config: ServerConfig) -> None:
    endpoint = config.endpoint
    scheme = endpoint.split("://", 1)[0]
    if scheme not in ("ipc", "tcp"):
        raise TransportError(f"endpoint {endpoint!r}: only ipc:// and tcp:// are supported")
    # Loopback is no exception: any local user can connect to it, and over tcp the
    # kernel tells nobody who that is.
    if scheme == "tcp" and not config.allow_insecure_tcp and not config.curve_secret_key_file:
        raise TransportError(
            f"endpoint {endpoint!r} is tcp without authentication; configure CURVE "
            "(server.curve_secret_key_file and server.curve_allowed_keys_file), use an "
            "ipc:// endpoint, or set server.allow_insecure_tcp: true"
        )


def private_directory(path: Path) -> Path:
    """``path`` as a directory only this user can enter: created mode 0700, or, if it
    exists, checked to be a directory (not a link) owned by this user and closed to
    others. Anything else is refused: another user who made it first could take the
    sockets placed in it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = path.lstat()
    except OSError as exc:
        raise TransportError(f"cannot create the sidecar's directory {path}: {exc}") from exc
    problem = not_private(status)
    if problem is not None:
        raise TransportError(f"{path} {problem}: refusing to put sockets in it")
    return path


class SidecarSocket:
    """A bound ROUTER socket; ``receive`` yields (routing id, peer, frames). Routing ids
    name connections; who is behind one is its ``Peer``, proven at the handshake."""

    def __init__(self, config: ServerConfig, tenancy: Tenancy) -> None:
        _check_endpoint(config)
        keys = curve_keys(config)  # read before anything needs closing
        self.ipc_path: Path | None = None
        if config.endpoint.startswith("ipc://"):
            self.ipc_path = Path(config.endpoint.removeprefix("ipc://"))
            if self.ipc_path.parent == runtime_dir():
                private_directory(self.ipc_path.parent)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._frames = FastSocket(self._socket, fair=True)
        self._peers: dict[tuple[str | None, str | None], Peer] = {}
        # The ZAP handler runs in its own thread, off the event loop, and is in place
        # before the socket can accept a handshake.
        self._authenticator = Gatekeeper(
            self._context, config.max_peers, tenancy, ipc=self.ipc_path is not None,
            curve_keys=None if keys is None else frozenset(keys[1]))
        self._authenticator.start()
        self._authenticator.watch(self._socket)
        self._socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        if keys is not None:
            secret_key, allowed_keys = keys
            self._socket.setsockopt(zmq.CURVE_SERVER, 1)
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
            log.info("server.curve.enabled", allowed_keys=len(allowed_keys))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.RCVHWM, config.rcvhwm)
        self._socket.setsockopt(zmq.SNDHWM, config.sndhwm)
        # ZMQ takes no frame past the frame limit (and a little slack, so that one just
        # over it gets an error reply, not a dropped connection): what a peer can queue at
        # the socket is at most rcvhwm such frames.
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes + FRAME_SLACK_BYTES)
        try:
            if self.ipc_path is not None:
                # Create the socket file owner-only from the start, not chmod'ed later.
                old_umask = os.umask(0o777 & ~config.ipc_permissions)
                try:
                    self._socket.bind(config.endpoint)
                finally:
                    os.umask(old_umask)
            else:
                self._socket.bind(config.endpoint)
        except zmq.ZMQError as exc:
            self._close_zmq()
            raise TransportError(f"cannot bind {config.endpoint}: {exc}") from exc
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    async def receive(self) -> tuple[bytes, Peer, list[bytes]]:
        """The connection's routing id, who it is, and the parts of its message: an
        engine sends one (more are refused, never joined: ZMQ bounds each part, not
        their number)."""
        routing, frames = await self._frames.recv_routed()
        return routing.bytes, self._peer(routing), frames

    def _peer(self, routing: zmq.Frame) -> Peer:
        principal, address = _property(routing, "User-Id"), _property(routing, "Peer-Address")
        peer = self._peers.get((principal, address))
        if peer is None:
            if len(self._peers) >= MAX_KNOWN_PEERS:
                self._peers.clear()
            credentials = None
            if self.ipc_path is not None and address is not None:
                credentials = peer_credentials(address)
            pid, uid = credentials or (None, None)
            # Every handshake passes the ZAP handler, which names every peer it admits.
            peer = self._peers[principal, address] = Peer(principal or "", pid, uid)
        return peer

    def waiting(self) -> bool:
        """Whether a frame waits to be received."""
        return self._frames.readable()

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Send one frame to an engine, never waiting; False if the engine cannot take
        it: it is gone, or its queue is full because it does not read its replies. A
        wait would hold up every other engine's replies (and, with no other engine's
        queue to watch, the receive loop itself, for good)."""
        try:
            self._frames.send_now([identity, frame])
        except zmq.Again:
            log.warning("server.send.dropped", identity=identity.hex(),
                        reason="the engine's queue is full: it is not reading its replies")
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                log.info("server.send.unreachable", identity=identity.hex())
                return False
            raise TransportError(f"send failed: {exc}") from exc
        return True

    def _close_zmq(self) -> None:
        self._frames.close()
        self._socket.disable_monitor()
        self._socket.close(0)
        self._authenticator.stop()
        self._context.term()

    def close(self) -> None:
        self._close_zmq()
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)

    def __enter__(self) -> SidecarSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _property(frame: zmq.Frame, name: str) -> str | None:
    try:
        return cast(str, frame.get(name))
    except zmq.ZMQError:  # not set for this connection
        return None


@contextlib.contextmanager
def hold_endpoint_of(config: ServerConfig) -> Iterator[None]:
    """Hold the endpoint's lock (``transport.liveness``) while inside: a sidecar holds
    it from before its backends open until after they closed (an ``ipc://`` endpoint
    with a file; others have none). Its directory is checked first, as the socket's."""
    endpoint = config.endpoint
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        yield
        return
    path = Path(endpoint.removeprefix("ipc://")).absolute()
    if path.parent == runtime_dir():
        private_directory(path.parent)
    with hold_endpoint(path):
        yield


def open_server_socket(config: ServerConfig, tenancy: Tenancy) -> SidecarSocket:
    return SidecarSocket(config, tenancy)
