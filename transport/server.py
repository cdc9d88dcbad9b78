"""The sidecar's ZMQ ROUTER endpoint: frames in, replies out, with explicit bounds.

High-water marks are set explicitly (never 0 = unbounded) so a sidecar that stops
reading pushes back on engines; ROUTER_MANDATORY makes a reply to a vanished engine an
error we can log instead of a silent drop. ipc:// sockets are owner-only by default,
and the default endpoint lives in the sidecar's own mode-0700 directory.

Every connection's handshake passes a ZAP handler (``_Gatekeeper``, in its own thread),
which proves who the peer is (its unix user on ipc://, its CURVE key, or ``insecure``
plain tcp where allowed), refuses identities the tenancy does not admit and one
connection past ``server.max_peers``. A refused peer's handshake fails, so none of its
messages reach the sidecar; every admitted message carries its identity.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import cast

import structlog
import zmq
import zmq.asyncio
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from pipeline.core.config import ServerConfig, runtime_dir
from pipeline.core.errors import ConfigError, TransportError
from pipeline.core.tenancy import INSECURE, Peer, Tenancy
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

ZAP_DOMAIN = "kvsidecar"
"""Every connection's handshake asks the ZAP handler, under this domain (without one,
libzmq asks it for CURVE connections only)."""

MAX_KNOWN_PEERS = 4096
"""Peers remembered by their handshake's metadata, so that a message's ``Peer`` is built
once per connection, not once per message."""

FRAME_SLACK_BYTES = 4096
"""How far past ``server.max_frame_bytes`` a frame is still read (and refused with an
error reply); a larger one closes its sender's connection."""


def _is_z85_key(token: str) -> bool:
    try:
        return len(token) == 40 and len(zmq.utils.z85.decode(token.encode())) == 32
    except (ValueError, KeyError, struct.error):
        return False


def read_key_file(path: str | os.PathLike[str]) -> list[bytes]:
    """The Z85 CURVE keys in a file, one per line; a line starting with ``#`` that is not
    a key, and text after a key and whitespace, are comments (``#`` is a Z85 digit)."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read CURVE key file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"CURVE key file {path} is not text") from exc
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.split(maxsplit=1)[0] if line.strip() else "#"
        if _is_z85_key(token):
            keys.append(token.encode())
        elif not token.startswith("#"):
            # The line itself is not echoed: it may hold a secret.
            raise ConfigError(f"CURVE key file {path}, line {number}: not a Z85 key")
    return keys


def load_key_pair(secret_key_file: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a file holding one secret key."""
    keys = read_key_file(secret_key_file)
    if len(keys) != 1:
        raise ConfigError(
            f"CURVE secret key file {secret_key_file} must hold one key, found {len(keys)}"
        )
    return zmq.curve_public(keys[0]), keys[0]


def load_public_key(public_key_file: str | os.PathLike[str]) -> bytes:
    """The Z85 key in a file holding one public key (``kvsidecar keygen``'s ``.key.pub``)."""
    keys = read_key_file(public_key_file)
    if len(keys) != 1:
        raise ConfigError(
            f"CURVE public key file {public_key_file} must hold one key, found {len(keys)}"
        )
    return keys[0]


class _Gatekeeper(ThreadAuthenticator):
    """The ZAP handler: every connection's handshake is decided here, and the identity it
    proves becomes the ``User-Id`` of each of its messages.

    - Past ``max_peers`` live connections, refused. They are counted from the socket's
      monitor events (accepted, closed: each names the connection's descriptor), read
      in the handler's own thread as each handshake asks: every connection asks once,
      after its own acceptance, so the events never pile up past two a connection, and
      the count includes the one asking.
    - CURVE: the peer's public key, admitted if allowed: ``curve:<Z85 key>``.
    - NULL on ``ipc://``: the peer's unix user from the kernel's peer credentials, which
      libzmq appends to the address (``:uid:gid:pid``): ``uid:<n>``.
    - NULL on tcp: ``insecure``, where the operator allowed plain tcp.
    Then the identity must be one the tenancy admits."""

    def __init__(self, context: zmq.asyncio.Context, max_peers: int, tenancy: Tenancy, *,
                 ipc: bool, curve_keys: frozenset[bytes] | None) -> None:
        super().__init__(context)
        self._max_peers = max_peers
        self._tenancy = tenancy
        self._ipc = ipc
        self._curve_keys = curve_keys
        self._live: set[int] = set()
        """The descriptors of the connections open."""
        self._events: zmq.Socket[bytes] | None = None

    def watch(self, socket: zmq.asyncio.Socket) -> None:
        """Count ``socket``'s connections (before it binds)."""
        endpoint = f"inproc://kvsidecar-peers-{id(self)}"
        socket.monitor(endpoint, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._events = self.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        self._events.setsockopt(zmq.RCVHWM, 1 << 20)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.connect(endpoint)

    def _live_peers(self) -> int:
        events = self._events
        while events is not None:
            try:
                event = parse_monitor_message(events.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._live.add(event["value"])
            else:
                self._live.discard(event["value"])
        return len(self._live)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6:
            if len(msg) >= 2:
                self._send_zap_reply(msg[1], b"400", b"malformed request")
            return
        request_id, address, mechanism, credentials = msg[1], msg[3], msg[5], msg[6:]
        if self._live_peers() > self._max_peers:
            log.warning("server.peer.refused", reason="too many peers",
                        max_peers=self._max_peers)
            self._send_zap_reply(request_id, b"400", b"too many peers")
            return
        principal = self._identify(address, mechanism, credentials)
        if principal is None or not self._tenancy.admits(principal):
            log.warning("server.peer.refused", reason="identity not admitted",
                        identity=principal or "unproven")
            self._send_zap_reply(request_id, b"400", b"not admitted")
            return
        self._send_zap_reply(request_id, b"200", b"OK", principal)

    def _identify(self, address: bytes, mechanism: bytes,
                  credentials: list[bytes]) -> str | None:
        """The identity a handshake proved, or None."""
        if mechanism == b"CURVE":
            if self._curve_keys is None or len(credentials) != 1:
                return None
            key = zmq.utils.z85.encode(credentials[0])
            if key not in self._curve_keys:
                log.warning("server.auth.refused", public_key=key.decode())
                return None
            return f"curve:{key.decode()}"
        if mechanism != b"NULL" or self._curve_keys is not None:
            return None
        if self._ipc:
            credentials_of = peer_credentials(address.decode(errors="replace"))
            return None if credentials_of is None else f"uid:{credentials_of[1]}"
        return INSECURE

    def stop(self) -> None:
        super().stop()
        if self._events is not None:
            self._events.close(0)
            self._events = None


def peer_credentials(address: str) -> tuple[int, int] | None:
    """(pid, uid) of an ``ipc://`` peer, from the address libzmq gives it: the kernel's
    peer credentials appended as ``:uid:gid:pid``."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(part.isdigit() for part in parts[1:]):
        return None
    return int(parts[3]), int(parts[1])


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
    if not stat.S_ISDIR(status.st_mode):
        raise TransportError(f"{path} is not a directory")
    if status.st_uid != os.getuid():
        raise TransportError(f"{path} belongs to uid {status.st_uid}, not to this user "
                             f"({os.getuid()}): refusing to put sockets in it")
    if status.st_mode & 0o077:
        raise TransportError(f"{path} is open to other users (mode "
                             f"{stat.S_IMODE(status.st_mode):o}); make it 0700")
    return path


def _curve_keys(config: ServerConfig) -> tuple[bytes, list[bytes]] | None:
    """(sidecar secret key, allowed engine public keys), or None when CURVE is off."""
    if not config.curve_secret_key_file:
        return None
    try:
        _, secret_key = load_key_pair(config.curve_secret_key_file)
    except ConfigError as exc:
        raise ConfigError(f"server.curve_secret_key_file: {exc}") from exc
    try:
        allowed_keys = read_key_file(config.curve_allowed_keys_file)
    except ConfigError as exc:
        raise ConfigError(f"server.curve_allowed_keys_file: {exc}") from exc
    if not allowed_keys:
        raise ConfigError(
            f"server.curve_allowed_keys_file: {config.curve_allowed_keys_file} lists no keys"
        )
    return secret_key, allowed_keys


class SidecarSocket:
    """A bound ROUTER socket; ``receive`` yields (routing id, peer, frames). Routing ids
    name connections; who is behind one is its ``Peer``, proven at the handshake."""

    def __init__(self, config: ServerConfig, tenancy: Tenancy) -> None:
        _check_endpoint(config)
        curve_keys = _curve_keys(config)  # read before anything needs closing
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
        self._authenticator = _Gatekeeper(
            self._context, config.max_peers, tenancy, ipc=self.ipc_path is not None,
            curve_keys=None if curve_keys is None else frozenset(curve_keys[1]))
        self._authenticator.start()
        self._authenticator.watch(self._socket)
        self._socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        if curve_keys is not None:
            secret_key, allowed_keys = curve_keys
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
