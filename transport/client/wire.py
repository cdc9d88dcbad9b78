"""One engine's conversation with a sidecar over a DEALER socket.

Replies are matched to calls by sequence number; whichever waiting call holds the receive
lock reads the socket and hands other calls their replies, so no background task is
needed. A save or load past its deadline is not walked away from: it is cancelled and
waited for until the sidecar can no longer touch its blocks (its late completion,
``Cancelled``, a reply of another epoch, or the endpoint's lock free). If the sidecar
neither answers nor can be proven gone, the wait goes on and is logged every
``HELD_LOG_S``; restarting the sidecar releases it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Sequence

import anyio
import anyio.from_thread
import structlog
import zmq
import zmq.asyncio

from pipeline.core.errors import ConfigError, ProtocolError, TransportError
from pipeline.core.messages import (
    Cancel,
    EngineMessage,
    Load,
    Save,
    SidecarMessage,
    decode_sidecar_message,
    encode,
)
from transport.liveness import sidecar_gone
from transport.sockets import FastSocket

__all__ = ["CANCEL_AGAIN_S", "GONE_CHECK_S", "HELD_LOG_S", "Conversation", "open_socket"]

GONE_CHECK_S = 0.25
"""How often a cancelled request's wait checks whether the sidecar is gone."""
CANCEL_AGAIN_S = 2.0
"""How often a cancel still unanswered is sent again."""
HELD_LOG_S = 10.0
"""How often a request still held by a silent sidecar is logged."""
log = structlog.get_logger("kvsidecar.client")


class Conversation:
    """Sequence-matched calls to one sidecar; the socket is closed by ``_close``."""

    def __init__(self, socket: zmq.asyncio.Socket, context: zmq.asyncio.Context,
                 timeout_s: float, *, curve: bool = False, endpoint: str = "") -> None:
        self._endpoint = endpoint
        self._epoch = 0
        """The epoch of the sidecar's last reply (0: none yet)."""
        self.held = 0
        """Requests given up on that the sidecar has not yet released: their blocks stay
        out of use until it answers or is proven gone."""
        self._socket = socket
        self._frames = FastSocket(socket)
        self._curve = curve
        self._context = context
        self._timeout_s = timeout_s
        self._seq = itertools.count(1)
        self._recv_lock = anyio.Lock(fast_acquire=True)  # uncontended: no loop trip
        self._replies: dict[int, SidecarMessage] = {}
        self._waiting: set[int] = set()
        self._closed = False

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)

    def _close(self) -> None:
        self._closed = True
        self._frames.close()
        self._socket.close(0)
        self._context.term()

    async def _exchange(
        self, seq: int, message: EngineMessage, timeout_s: float | None = None,
        spin_s: float = 0.0,
    ) -> SidecarMessage:
        if self._closed:
            raise TransportError("client is closed")
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        self._waiting.add(seq)
        sent_epoch = 0
        try:
            # asyncio's own deadline, not anyio's: a request's round trip is the latency an
            # engine waits on, and anyio's cancel scope adds about 10 µs to it (measured;
            # the socket is asyncio's anyway). Cancellation from outside passes through.
            try:
                async with asyncio.timeout(timeout_s):
                    # Inside the deadline: with no sidecar, a full queue would block the send.
                    await self._frames.send_multipart([encode(message)])
                    sent_epoch = self._epoch or -1
                    await self._receive_until((seq,), spin_s)
            except TimeoutError as exc:
                if not sent_epoch or not isinstance(message, Save | Load):
                    raise self._timed_out(message, timeout_s) from exc
                # Sent: the sidecar may be about to touch the blocks. Hold them until it
                # cannot.
                await self._give_up(seq, message, sent_epoch)
                if seq not in self._replies:
                    raise self._timed_out(message, timeout_s) from exc
        finally:
            self._waiting.discard(seq)
            reply_or_none = self._replies.pop(seq, None)
        if reply_or_none is None:
            raise ProtocolError("reply lost")
        return reply_or_none

    async def _receive_until(self, seqs: Sequence[int], spin_s: float = 0.0) -> None:
        """Read the socket (or let the call holding it read) until a reply to one of
        ``seqs`` is in, filing every reply for the call that waits for it."""
        replies = self._replies
        while not any(seq in replies for seq in seqs):
            async with self._recv_lock:
                if any(seq in replies for seq in seqs):
                    break
                # Poll only while nothing else of the engine's waits on the loop.
                frames = await self._frames.recv_multipart(
                    spin_s if len(self._waiting) == 1 else 0.0)
                reply = decode_sidecar_message(b"".join(frames))
                if reply.epoch:
                    self._epoch = reply.epoch
                reply_seq = getattr(reply, "seq", 0)
                if reply_seq in self._waiting:  # else: a call that gave up on it
                    replies[reply_seq] = reply

    async def _give_up(self, seq: int, message: Save | Load, sent_epoch: int) -> None:
        """Cancel request ``seq`` and wait until the sidecar can no longer touch its
        blocks: its completion (filed under ``seq``), ``Cancelled``, a reply of another
        epoch than ``sent_epoch`` (a new incarnation: the old one is gone), or the
        endpoint's lock free. No timer alone ends the wait."""
        cancel = next(self._seq)
        self._waiting.add(cancel)
        self.held += 1
        started = time.monotonic()
        logged = started
        sent_at = -math.inf
        try:
            while True:
                with anyio.move_on_after(GONE_CHECK_S):
                    # Sent again now and then: a sidecar that took the first one and died
                    # cannot answer it, and a new one answers one at once (with its epoch).
                    # A stalled sidecar's full queue blocks the send: within the wait.
                    if time.monotonic() - sent_at > CANCEL_AGAIN_S:
                        await self._frames.send_multipart([encode(Cancel(cancel, seq))])
                        sent_at = time.monotonic()
                    await self._receive_until((seq, cancel))
                if seq in self._replies or cancel in self._replies:
                    return
                if sent_epoch not in (-1, self._epoch) or sidecar_gone(self._endpoint):
                    log.warning("client.request.released", request_id=message.request_id,
                                reason="the sidecar is gone", held_s=round(
                                    time.monotonic() - started, 1))
                    return
                if time.monotonic() - logged > HELD_LOG_S:
                    logged = time.monotonic()
                    log.warning("client.request.held", request_id=message.request_id,
                                kind=type(message).__name__.lower(),
                                held_s=round(logged - started, 1),
                                reason="cancelled; the sidecar has not answered and is not "
                                       "known to be gone (restarting it releases the blocks)")
        finally:
            self.held -= 1
            self._waiting.discard(cancel)
            self._replies.pop(cancel, None)

    def _timed_out(self, message: EngineMessage, timeout_s: float) -> TransportError:
        hint = (
            "; CURVE keys are configured: the sidecar may have refused this engine's key "
            "(authentication failed: is its public key in server.curve_allowed_keys_file, "
            "and is curve_server_key the sidecar's public key?)"
            if self._curve
            else ""
        )
        what = (" (cancelled: the sidecar no longer touches its blocks)"
                if isinstance(message, Save | Load) else "")
        return TransportError(
            f"no reply from the sidecar within {timeout_s}s ({type(message).__name__})"
            f"{what}{hint}")


def open_socket(
    endpoint: str, curve_server_key: str | bytes | None,
    curve_key_pair: tuple[str | bytes, str | bytes] | None,
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Context]:
    """A DEALER socket connected to ``endpoint``, with CURVE when keys are given."""
    if (curve_server_key is None) != (curve_key_pair is None):
        raise ConfigError("curve_server_key and curve_key_pair must be given together")
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 1000)
    socket.setsockopt(zmq.RCVHWM, 1000)
    if curve_server_key is not None and curve_key_pair is not None:
        try:
            socket.setsockopt(zmq.CURVE_SERVERKEY, _key_bytes(curve_server_key))
            socket.setsockopt(zmq.CURVE_PUBLICKEY, _key_bytes(curve_key_pair[0]))
            socket.setsockopt(zmq.CURVE_SECRETKEY, _key_bytes(curve_key_pair[1]))
        except zmq.ZMQError as exc:
            socket.close(0)
            context.term()
            raise ConfigError(f"invalid CURVE key (Z85, 40 characters): {exc}") from exc
    socket.connect(endpoint)
    return socket, context


def _key_bytes(key: str | bytes) -> bytes:
    # A key read from a ``.key.pub`` file carries its newline.
    return (key.encode() if isinstance(key, str) else key).strip()

