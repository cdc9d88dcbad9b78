"""The sidecar's ZMQ ROUTER endpoint: frames in, replies out, with explicit bounds.

High-water marks are set explicitly (never 0 = unbounded) so a sidecar that stops
reading pushes back on engines; ROUTER_MANDATORY makes a reply to a vanished engine an
error we can log instead of a silent drop. ipc:// sockets are owner-only by default.

Every connection's handshake passes a ZAP handler (pyzmq's authenticator, in its own
thread), which refuses one past ``server.max_peers`` live connections. With
``server.curve_secret_key_file`` set, the socket is a CURVE server and the handler also
admits only the engine public keys listed in ``curve_allowed_keys_file``. A refused
peer's handshake fails, so none of its messages reach the sidecar.
"""

from __future__ import annotations

import ipaddress
import os
import struct
import urllib.parse
from pathlib import Path
from types import TracebackType

import structlog
import zmq
import zmq.asyncio
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from pipeline.core.config import ServerConfig
from pipeline.core.errors import ConfigError, TransportError
from transport.sockets import FastSocket

__all__ = [
    "SidecarSocket",
    "load_key_pair",
    "load_public_key",
    "open_server_socket",
    "read_key_file",
]

log = structlog.get_logger("kvsidecar.server")

ZAP_DOMAIN = "kvsidecar"
"""Every connection's handshake asks the ZAP handler, under this domain (without one,
libzmq asks it for CURVE connections only)."""

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


class _AllowedKeys:
    """pyzmq credentials provider: admits the listed engine public keys."""

    def __init__(self, keys: list[bytes]) -> None:
        self._keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
            log.warning("server.auth.refused", public_key=key.decode())
        return allowed


class _Gatekeeper(ThreadAuthenticator):
    """The ZAP handler: refuses a connection while ``max_peers`` are live, then leaves the
    rest (CURVE keys, where configured) to pyzmq's authenticator.

    Live connections are counted from the socket's monitor events (accepted, closed:
    each names the connection's descriptor), read in the handler's own thread as each
    handshake asks: every connection asks once, after its own acceptance, so the events
    never pile up past two a connection, and the count includes the one asking."""

    def __init__(self, context: zmq.asyncio.Context, max_peers: int) -> None:
        super().__init__(context)
        self._max_peers = max_peers
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
        if len(msg) >= 2 and self._live_peers() > self._max_peers:
            log.warning("server.peer.refused", reason="too many peers",
                        max_peers=self._max_peers)
            self._send_zap_reply(msg[1], b"400", b"too many peers")
            return
        await super().handle_zap_message(msg)

    def stop(self) -> None:
        super().stop()
        if self._events is not None:
            self._events.close(0)
            self._events = None


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
        if not loopback and not config.allow_insecure_tcp and not config.curve_secret_key_file:
            raise TransportError(
                f"endpoint {endpoint!r} listens beyond loopback without authentication; "
                "configure CURVE (server.curve_secret_key_file and "
                "server.curve_allowed_keys_file) or set server.allow_insecure_tcp: true"
            )


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
    """A bound ROUTER socket; ``receive`` yields (engine identity, frame)."""

    def __init__(self, config: ServerConfig) -> None:
        _check_endpoint(config)
        curve_keys = _curve_keys(config)  # read before anything needs closing
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._frames = FastSocket(self._socket, fair=True)
        # The ZAP handler runs in its own thread, off the event loop, and is in place
        # before the socket can accept a handshake.
        self._authenticator = _Gatekeeper(self._context, config.max_peers)
        self._authenticator.start()
        self._authenticator.watch(self._socket)
        self._socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        if curve_keys is not None:
            secret_key, allowed_keys = curve_keys
            self._authenticator.configure_curve_callback(
                domain=ZAP_DOMAIN,
                credentials_provider=_AllowedKeys(allowed_keys)
            )
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
            self._close_zmq()
            raise TransportError(f"cannot bind {config.endpoint}: {exc}") from exc
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    async def receive(self) -> tuple[bytes, list[bytes]]:
        """The sender's identity and the parts of its message: an engine sends one (more
        are refused, never joined: ZMQ bounds each part, not their number)."""
        identity, *frames = await self._frames.recv_multipart()
        return identity, frames

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
