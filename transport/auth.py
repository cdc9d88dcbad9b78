"""Who a peer is: the ZAP handler every connection's handshake passes, and the CURVE keys.

The handler (``Gatekeeper``, in its own thread) proves who the peer is (its unix user on
ipc://, its CURVE key, or ``insecure`` plain tcp where allowed), refuses identities the
tenancy does not admit and one connection past ``server.max_peers``. A refused peer's
handshake fails, so none of its messages reach the sidecar.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import structlog
import zmq
import zmq.asyncio
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from pipeline.core.config import ServerConfig
from pipeline.core.errors import ConfigError
from pipeline.core.tenancy import INSECURE, Tenancy

__all__ = [
    "MAX_KNOWN_PEERS",
    "ZAP_DOMAIN",
    "Gatekeeper",
    "curve_keys",
    "load_key_pair",
    "load_public_key",
    "peer_credentials",
    "read_key_file",
]

log = structlog.get_logger("kvsidecar.server")

ZAP_DOMAIN = "kvsidecar"
"""Every connection's handshake asks the ZAP handler, under this domain (without one,
libzmq asks it for CURVE connections only)."""

MAX_KNOWN_PEERS = 4096
"""Peers remembered by their handshake's metadata, so that a message's ``Peer`` is built
once per connection, not once per message."""

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


class Gatekeeper(ThreadAuthenticator):
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


def curve_keys(config: ServerConfig) -> tuple[bytes, list[bytes]] | None:
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
