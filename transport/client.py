"""The engine side: an async client (DEALER) and a thin blocking wrapper for engine threads.

An engine allocates its KV tensors with ``transport.tensors.shared_kv_tensor``, connects
with its layout and tensors, then sends scheduler events. Replies are matched to calls
by sequence number; whichever waiting call holds the receive lock reads the socket and
hands other calls their replies, so no background task is needed.

A save or load carries its deadline (now plus its timeout). Past it the client does not
walk away: it cancels the request and waits until the sidecar can no longer touch the
blocks (the request's late completion, ``Cancelled``, or proof that the sidecar is gone:
its endpoint's lock free, or a reply of another epoch). Only then does the call return
or raise, so an engine may reuse a request's blocks once its call is over, whatever
happened. If the sidecar neither answers nor can be proven gone, the call waits, and
says so in the log every ``HELD_LOG_S``; restarting the sidecar releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal, TypeVar, overload

import anyio
import anyio.from_thread
import msgspec
import structlog
import torch
import zmq
import zmq.asyncio
from anyio.abc import AsyncResource

from pipeline.core.errors import ConfigError, ProtocolError, RequestRejected, TransportError
from pipeline.core.hashing import MMItem, block_hashes
from pipeline.core.layout import NULL_BLOCK_ID, KVCacheLayout
from pipeline.core.messages import (
    SIDECAR_HASH_ALGO,
    BlockReport,
    BlockWhy,
    Cancel,
    CudaIpcEvent,
    EngineMessage,
    ErrorCode,
    ErrorReply,
    Explain,
    Handover,
    HandoverTicket,
    HashSelfTest,
    Heartbeat,
    Load,
    LoadDone,
    Lookup,
    LookupReply,
    Register,
    Registered,
    RequestKeys,
    Save,
    SaveDone,
    SidecarMessage,
    Unregister,
    decode_sidecar_message,
    encode,
    pack_tokens,
)
from pipeline.core.outcomes import OVERLOADED, BlockStatus
from transport.handover import hand_over
from transport.liveness import sidecar_gone
from transport.sockets import FastSocket
from transport.tensors import Segments, tensor_handle

__all__ = [
    "BlockingEngineClient", "EngineClient", "Explanation", "InlineLookupClient", "LoadResult",
    "PendingLookup", "SaveResult", "lookup_message",
]

KVCacheShape = Literal["blocks_first", "kv_first"]
LOOKUP_SPIN_S = 0.001
"""``EngineClient.connect``'s default ``lookup_spin_s``."""
BlockHasher = Callable[[Sequence[int], int], list[bytes]]
GONE_CHECK_S = 0.25
"""How often a cancelled request's wait checks whether the sidecar is gone."""
CANCEL_AGAIN_S = 2.0
"""How often a cancel still unanswered is sent again."""
HELD_LOG_S = 10.0
"""How often a request still held by a silent sidecar is logged."""
_T = TypeVar("_T")
log = structlog.get_logger("kvsidecar.client")


@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    stored: int
    present: int
    skipped: int
    failed: int
    blocks: tuple[BlockReport, ...]
    shed: bool = False
    """Never sent: the sidecar had said it would refuse it (``EngineClient.save``)."""

    @classmethod
    def from_reply(cls, reply: SaveDone, *, shed: bool = False) -> SaveResult:
        count = {status: 0 for status in BlockStatus}
        for block in reply.blocks:
            count[block.status] += 1
        return cls(count[BlockStatus.STORED], count[BlockStatus.PRESENT],
                   count[BlockStatus.SKIPPED], count[BlockStatus.FAILED], reply.blocks,
                   shed)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    loaded_tokens: int
    invalid_block_ids: tuple[int, ...]
    blocks: tuple[BlockReport, ...]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """A lookup's hit and, for every full block of every stored group, why it is or is
    not a hit."""

    hit_tokens: int
    blocks: tuple[BlockWhy, ...]


def _request_keys(
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MMItem] = (),
) -> RequestKeys:
    return RequestKeys(lora_name, lora_path, cache_salt, tuple(tuple(i) for i in mm_items))  # type: ignore[misc]


def _overloaded(request_id: str, block_ids: Sequence[Sequence[int]],
                store_group_ids: Sequence[int]) -> SaveDone:
    """The sidecar's answer to a save it refuses as overloaded: every block of every
    stored group, null blocks left out, skipped."""
    status, reason = OVERLOADED.status, OVERLOADED.reason
    return SaveDone(0, request_id, tuple(
        BlockReport(group_id, index, block_id, status, reason)
        for group_id in store_group_ids
        for index, block_id in enumerate(block_ids[group_id]) if block_id != NULL_BLOCK_ID
    ), save_credits=0)


def _block_dim(tensor: torch.Tensor, shape: KVCacheShape | None) -> int:
    if shape is not None:
        return 0 if shape == "blocks_first" else 1
    # vLLM's K/V-first tensors are [2, num_blocks, ...]; anything else is blocks-first.
    return 1 if tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] != 2 else 0


def _step_event(
    kv_caches: Mapping[str, torch.Tensor], payload: set[str]
) -> tuple[torch.cuda.Event | None, CudaIpcEvent | None]:
    """The step event of an engine whose shared KV is on a GPU (one device)."""
    devices = {tensor.device for layer, tensor in kv_caches.items()
               if layer in payload and tensor.device.type == "cuda"}
    if not devices:
        return None, None
    if len(devices) > 1:
        raise ConfigError(f"an engine's KV tensors are on one GPU, not {sorted(map(str, devices))}")
    from transport.cuda_ipc import step_event

    return step_event(devices.pop().index or 0)


class EngineClient(AsyncResource):
    """An engine's connection to a sidecar. Use ``await EngineClient.connect(...)``."""

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
        self.lookup_spin_s = LOOKUP_SPIN_S
        """How long a lookup polls for its reply (``connect``'s ``lookup_spin_s``)."""
        self._seq = itertools.count(1)
        self._recv_lock = anyio.Lock(fast_acquire=True)  # uncontended: no loop trip
        self._register_lock = anyio.Lock()
        self._replies: dict[int, SidecarMessage] = {}
        self._waiting: set[int] = set()
        self._closed = False
        self._registration: Register | None = None
        self._segments = Segments()
        """The memory files the registration hands over."""
        self._step: torch.cuda.Event | None = None
        self.registered: Registered | None = None
        self.save_credits = -1
        """Saves the sidecar would accept now, from its last reply (0: skip saving;
        -1: not known or never refused)."""
        self.saves_shed = 0
        """Saves answered here as overloaded, never sent (``save``)."""
        self._saves_waiting = 0
        self._kv_groups = 0

    @classmethod
    async def connect(
        cls,
        endpoint: str,
        *,
        layout: KVCacheLayout | Mapping[str, Any],
        kv_caches: Mapping[str, torch.Tensor],
        engine_id: str | None = None,
        kv_cache_shape: KVCacheShape | None = None,
        hash_seed: str | None = None,
        block_hasher: BlockHasher | None = None,
        hash_algo: str = SIDECAR_HASH_ALGO,
        lookup_only: bool = False,
        share_in_place: bool = False,
        timeout_s: float = 30.0,
        lookup_spin_s: float = LOOKUP_SPIN_S,
        curve_server_key: str | bytes | None = None,
        curve_key_pair: tuple[str | bytes, str | bytes] | None = None,
    ) -> EngineClient:
        """Connect and register. Only the tensors of stored groups' layers are shared.

        ``hash_seed`` is the engine's ``PYTHONHASHSEED`` (None: the default seed).
        ``block_hasher(tokens, hash_block_size)`` is the engine's own block hasher for the
        registration self-test (default: kvsidecar's, i.e. vLLM-compatible hashing).
        ``hash_algo`` names it (vLLM's ``prefix_caching_hash_algo``); with any but
        ``sha256_cbor`` every request must carry the engine's block hashes.
        ``lookup_only``: this connection only looks up (no tensors, no saves or loads).
        ``share_in_place``: tensors the engine allocated itself are moved into shared
        memory in place instead of being refused (``transport.tensors.tensor_handle``).
        ``curve_server_key`` (the sidecar's public key) and ``curve_key_pair`` (this
        engine's public and secret keys, all Z85) connect to a sidecar that has CURVE on;
        ``transport.server.load_key_pair`` reads a pair from a ``kvsidecar keygen`` file.
        ``lookup_spin_s``: a lookup that is the only call awaiting a reply polls for it
        this long, holding the event loop, before it sleeps on the socket: on an idle
        core the wake-up from that sleep can cost as much as the lookup (0: never poll).
        """
        if not isinstance(layout, KVCacheLayout):
            layout = KVCacheLayout.from_dict(layout)
        payload = {layer for layers in layout.payload_layers for layer in layers}
        segments = Segments()
        handles = tuple(
            tensor_handle(layer, tensor, segments,
                          block_dim=_block_dim(tensor, kv_cache_shape),
                          share_in_place=share_in_place)
            for layer, tensor in kv_caches.items()
            if layer in payload
        )
        step, step_handle = _step_event(kv_caches, payload)
        tokens = tuple(range(1, 2 * layout.hash_block_size + 1))
        hasher = block_hasher or (lambda t, size: block_hashes(t, size, seed=hash_seed))
        self_test = HashSelfTest(tokens, tuple(hasher(tokens, layout.hash_block_size)))
        engine_id = engine_id or f"engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        client = cls._connect(endpoint, timeout_s, curve_server_key, curve_key_pair)
        client.lookup_spin_s = lookup_spin_s
        client._step = step
        client._segments = segments
        client._registration = Register(engine_id, layout, handles, self_test, hash_seed,
                                        hash_algo=hash_algo, lookup_only=lookup_only,
                                        step_event=step_handle)
        try:
            reply = await client._register()
            if isinstance(reply, ErrorReply):
                raise RequestRejected(reply.code, reply.message)
        except BaseException:
            await client.aclose()
            raise
        assert isinstance(reply, Registered)
        client.registered = reply
        client._kv_groups = len(layout.groups)
        return client

    async def _register(self) -> SidecarMessage:
        """Hand the engine's memory files over on a fresh ticket, if it shares any, then
        register: the sidecar's reply."""
        registration = self._registration
        assert registration is not None
        if self._segments.fds:
            seq = next(self._seq)
            ticket = await self._exchange(seq, Handover(seq))
            if not isinstance(ticket, HandoverTicket):
                return ticket
            await anyio.to_thread.run_sync(functools.partial(
                hand_over, ticket.path, ticket.token, self._segments.fds,
                timeout_s=self._timeout_s))
            registration = msgspec.structs.replace(registration, handover=ticket.token)
        return await self._exchange(0, registration)

    @classmethod
    def _connect(
        cls, endpoint: str, timeout_s: float,
        curve_server_key: str | bytes | None,
        curve_key_pair: tuple[str | bytes, str | bytes] | None,
    ) -> EngineClient:
        """A client on a connected DEALER socket, not registered."""
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
        return cls(socket, context, timeout_s, curve=curve_server_key is not None,
                   endpoint=endpoint)

    @classmethod
    async def explain_for(
        cls,
        endpoint: str,
        *,
        engine_id: str = "",
        token_ids: Sequence[int] = (),
        block_hashes: Sequence[bytes] | None = None,
        timeout_s: float = 30.0,
        curve_server_key: str | bytes | None = None,
        curve_key_pair: tuple[str | bytes, str | bytes] | None = None,
        **request_keys: Any,
    ) -> Explanation:
        """Why a prompt (its tokens, or only its block hashes) hits or misses, as the
        registered engine ``engine_id`` ("": the only one) sees it. Needs no registration
        of its own: an operator's tool."""
        async with cls._connect(endpoint, timeout_s, curve_server_key,
                                curve_key_pair) as client:
            reply = await client._call(1, Explain(
                1, engine_id, pack_tokens(list(token_ids)), _request_keys(**request_keys),
                _hashes(block_hashes)))
        assert isinstance(reply, LookupReply)
        return Explanation(reply.hit_tokens, reply.explain or ())

    async def run_heartbeats(self, interval_s: float = 5.0) -> None:
        """Send a heartbeat every ``interval_s`` until cancelled, so an idle engine is not
        reaped (any request counts as one too). Run it in the engine's task group."""
        while True:
            await anyio.sleep(interval_s)
            with contextlib.suppress(TransportError, RequestRejected):
                await self.heartbeat()

    @overload
    async def lookup(
        self, token_ids: Sequence[int], *, request_id: str | None = None,
        block_hashes: Sequence[bytes] | None = None, timeout_s: float | None = None,
        explain: Literal[False] = False, **request_keys: Any,
    ) -> int: ...

    @overload
    async def lookup(
        self, token_ids: Sequence[int], *, request_id: str | None = None,
        block_hashes: Sequence[bytes] | None = None, timeout_s: float | None = None,
        explain: Literal[True], **request_keys: Any,
    ) -> Explanation: ...

    async def lookup(
        self,
        token_ids: Sequence[int],
        *,
        request_id: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
        explain: bool = False,
        **request_keys: Any,
    ) -> int | Explanation:
        """Tokens from the start of the request that can be loaded (a multiple of the
        alignment, never the last token). ``timeout_s`` overrides the client's, as in
        ``save`` and ``load``.

        ``block_hashes``: the engine's own fine block hashes of ``token_ids`` (vLLM's
        ``request.block_hashes``), sparing the sidecar the hashing; optional everywhere.
        ``request_id``: the sidecar keeps this request's hashes for its next lookup, load
        and save, so a request looked up again and again is hashed once.
        ``explain``: return an ``Explanation`` instead: the hit, and block by block why
        each is or is not a hit.
        """
        seq = next(self._seq)
        registered = self.registered
        message = lookup_message(
            seq, token_ids, registered.hash_block_size if registered else None,
            keys=_request_keys(**request_keys), block_hashes=block_hashes,
            request_id=request_id, explain=explain,
        )
        reply = await self._call(seq, message, timeout_s, spin_s=self.lookup_spin_s)
        assert isinstance(reply, LookupReply)
        self.save_credits = reply.save_credits
        if explain:
            return Explanation(reply.hit_tokens, reply.explain or ())
        return reply.hit_tokens

    async def save(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        *,
        block_hashes: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
        mark_step: bool = True,
        **request_keys: Any,
    ) -> SaveResult:
        """Store the request's full blocks; the engine may reuse them once this returns
        or raises (past ``timeout_s`` the save is cancelled, and this returns its late
        completion, or raises ``TransportError`` once the sidecar cannot touch them).

        KV in GPU memory: the save first marks the step (``mark_step``), so the sidecar
        copies the blocks only once the work queued so far on this thread's current
        stream is done; ``mark_step=False`` when it was marked already.

        A save the sidecar has said it would refuse is not sent: while its last reply
        gave no save credits and a save of this engine still awaits its reply (which
        brings fresh credits), every block is answered here as skipped, overloaded
        (``shed``), as the sidecar would have answered it. Under a flood, neither side
        then spends a round trip on it, and the blocks are free at once. Once no save
        awaits a reply, the next one is sent whatever the credits were: its reply tells
        whether the sidecar has room again."""
        if (self.save_credits == 0 and self._saves_waiting and self.registered is not None
                and len(block_ids) == self._kv_groups):  # else the sidecar says what is wrong
            self.saves_shed += 1
            return SaveResult.from_reply(
                _overloaded(request_id, block_ids, self.registered.store_group_ids),
                shed=True)
        if mark_step:
            self.mark_step()
        seq = next(self._seq)
        message = Save(seq, request_id, pack_tokens(token_ids), _blocks(block_ids),
                       _request_keys(**request_keys), _hashes(block_hashes),
                       deadline=self._deadline(timeout_s))
        self._saves_waiting += 1
        try:
            reply = await self._call(seq, message, timeout_s)
        finally:
            self._saves_waiting -= 1
        assert isinstance(reply, SaveDone)
        self.save_credits = reply.save_credits
        return SaveResult.from_reply(reply)

    def mark_step(self) -> None:
        """Record the step event on this thread's current CUDA stream: the sidecar's
        next copies of this engine's GPU blocks wait for what was queued before it (the
        forward that wrote them). Nothing to do for KV in CPU memory."""
        if self._step is not None:
            self._step.record()

    async def load(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        block_hashes: Sequence[bytes] | None = None,
        computed_tokens: int = 0,
        timeout_s: float | None = None,
        **request_keys: Any,
    ) -> LoadResult:
        """Load the first ``num_tokens`` tokens' blocks into ``block_ids``; blocks that end
        within the first ``computed_tokens`` (already in the engine) are left alone. Past
        ``timeout_s`` the load is cancelled as a save is (``save``): once this returns or
        raises, the sidecar writes none of the blocks any more."""
        seq = next(self._seq)
        message = Load(seq, request_id, pack_tokens(token_ids), _blocks(block_ids), num_tokens,
                       _request_keys(**request_keys), _hashes(block_hashes), computed_tokens,
                       deadline=self._deadline(timeout_s))
        reply = await self._call(seq, message, timeout_s)
        assert isinstance(reply, LoadDone)
        return LoadResult(reply.loaded_tokens, reply.invalid_block_ids, reply.blocks)

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)

    async def heartbeat(self) -> None:
        seq = next(self._seq)
        await self._call(seq, Heartbeat(seq))

    async def aclose(self) -> None:
        if self._closed:
            return
        if self.registered is not None:
            # Tell the sidecar to release our mappings now rather than at reaping time.
            with anyio.move_on_after(1), contextlib.suppress(Exception):
                self._timeout_s = 1.0
                seq = next(self._seq)
                await self._call(seq, Unregister(seq))
        self._closed = True
        self._frames.close()
        self._socket.close(0)
        self._context.term()

    async def _call(
        self, seq: int, message: EngineMessage, timeout_s: float | None = None, *,
        spin_s: float = 0.0,
    ) -> SidecarMessage:
        """Send and wait for the reply; re-register once if the sidecar forgot us.
        ``spin_s``: poll for the reply this long first, when no other call waits."""
        known = self.registered
        reply = await self._exchange(seq, message, timeout_s, spin_s)
        if (
            isinstance(reply, ErrorReply)
            and reply.code == ErrorCode.NOT_REGISTERED
            and self._registration is not None
        ):
            # The sidecar restarted or reaped us: register again (once, however many
            # calls found out at the same time), then retry once.
            async with self._register_lock:
                if self.registered is known:
                    registered = await self._register()
                    if not isinstance(registered, Registered):
                        reply = registered
                    else:
                        self.registered = registered
            if self.registered is not known:
                if isinstance(message, Save | Load):  # its own time again, not what is left
                    message = msgspec.structs.replace(message,
                                                      deadline=self._deadline(timeout_s))
                reply = await self._exchange(seq, message, timeout_s)
        if isinstance(reply, ErrorReply):
            raise RequestRejected(reply.code, reply.message)
        return reply

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


def _key_bytes(key: str | bytes) -> bytes:
    # A key read from a ``.key.pub`` file carries its newline.
    return (key.encode() if isinstance(key, str) else key).strip()


def lookup_message(
    seq: int, token_ids: Sequence[int], hash_block_size: int | None, *,
    keys: RequestKeys | None = None, block_hashes: Sequence[bytes] | None = None,
    request_id: str | None = None, explain: bool = False,
) -> Lookup:
    """A lookup as an engine sends it. With the engine's block hashes (and no
    explanation asked) only the prompt's first hash block goes, the one its first hash
    is checked against, and the prompt's length: the hashes name every block.
    ``hash_block_size``: the registered layout's (None: not registered; all is sent)."""
    head = block_hashes is not None and not explain and hash_block_size is not None
    return Lookup(seq, pack_tokens(token_ids[:hash_block_size] if head else token_ids),
                  keys or RequestKeys(), _hashes(block_hashes), request_id, explain=explain,
                  prompt_tokens=len(token_ids) if head else None)


def _hashes(block_hashes: Sequence[bytes] | None) -> tuple[bytes, ...] | None:
    return None if block_hashes is None else tuple(block_hashes)


def _blocks(block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in ids) for ids in block_ids)


class BlockingEngineClient:
    """The same API for engine threads that do not run an event loop."""

    def __init__(
        self, endpoint: str, *, heartbeat_interval_s: float = 5.0, **connect_kwargs: Any
    ) -> None:
        """Connect like ``EngineClient.connect``; heartbeats run in the client's own thread."""
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._client: EngineClient = self._portal.call(
                lambda: EngineClient.connect(endpoint, **connect_kwargs)
            )
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._heartbeats = self._portal.start_task_soon(
            self._client.run_heartbeats, heartbeat_interval_s
        )

    @property
    def registered(self) -> Registered | None:
        return self._client.registered

    def lookup(self, token_ids: Sequence[int], **request_keys: Any) -> int:
        hit: int = self._portal.call(lambda: self._client.lookup(token_ids, **request_keys))
        return hit

    def save(self, request_id: str, token_ids: Sequence[int],
             block_ids: Sequence[Sequence[int]], **request_keys: Any) -> SaveResult:
        self._client.mark_step()  # on the caller's stream, not the client thread's
        return self._portal.call(
            lambda: self._client.save(request_id, token_ids, block_ids, mark_step=False,
                                      **request_keys)
        )

    def load(self, request_id: str, token_ids: Sequence[int],
             block_ids: Sequence[Sequence[int]], num_tokens: int,
             **request_keys: Any) -> LoadResult:
        return self._portal.call(
            lambda: self._client.load(request_id, token_ids, block_ids, num_tokens,
                                      **request_keys)
        )

    def start_lookup(self, token_ids: Sequence[int], **kwargs: Any) -> Future[int]:
        """``lookup`` without waiting: the result arrives in the future."""
        return self._portal.start_task_soon(functools.partial(self._client.lookup, token_ids,
                                                              **kwargs))

    def start_save(self, request_id: str, token_ids: Sequence[int],
                   block_ids: Sequence[Sequence[int]], **kwargs: Any) -> Future[SaveResult]:
        """``save`` without waiting: the result arrives in the future."""
        self._client.mark_step()
        return self._portal.start_task_soon(
            functools.partial(self._client.save, request_id, token_ids, block_ids,
                              mark_step=False, **kwargs)
        )

    def start_load(self, request_id: str, token_ids: Sequence[int],
                   block_ids: Sequence[Sequence[int]], num_tokens: int,
                   **kwargs: Any) -> Future[LoadResult]:
        """``load`` without waiting: the result arrives in the future."""
        return self._portal.start_task_soon(
            functools.partial(self._client.load, request_id, token_ids, block_ids, num_tokens,
                              **kwargs)
        )

    def close(self) -> None:
        try:
            self._heartbeats.cancel()
            self._portal.call(self._client.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> BlockingEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingLookup:
    """A lookup started by ``InlineLookupClient.start_lookup``: ``result`` and ``done`` as
    a ``concurrent.futures.Future``'s, the lookup progressing only inside ``result``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[int]) -> None:
        self._loop = loop
        self._task = task

    def done(self) -> bool:
        return self._task.done()

    def result(self, timeout: float | None = None) -> int:
        """The hit, waiting up to ``timeout`` for it (``concurrent.futures.TimeoutError``
        after that, the lookup still pending); the lookup's own error is raised."""
        if not self._task.done():
            _run_inline(self._loop, lambda: asyncio.wait((self._task,), timeout=timeout))
        if not self._task.done():
            raise FutureTimeout
        return self._task.result()

    def cancel(self) -> bool:
        return self._task.cancel()


class InlineLookupClient:
    """Lookups for an engine thread that waits on them itself, as vLLM's scheduler does:
    the client's event loop runs in the calling thread, and only while a call waits. A
    lookup then costs the engine no hop to another thread and back (through
    ``BlockingEngineClient``'s, one without any work took 210-280 µs here, as much
    again as the lookup). No heartbeats: a registration the sidecar reaped while the
    engine sent nothing is made again by the next lookup. Not for a thread that runs an
    event loop of its own (use ``EngineClient`` there)."""

    def __init__(self, endpoint: str, **connect_kwargs: Any) -> None:
        """Connect like ``EngineClient.connect`` (a lookup-only registration)."""
        self._loop = asyncio.new_event_loop()
        try:
            self._client: EngineClient = _run_inline(self._loop, lambda: EngineClient.connect(
                endpoint, kv_caches={}, lookup_only=True, **connect_kwargs))
        except BaseException:
            self._loop.close()
            raise

    @property
    def registered(self) -> Registered | None:
        return self._client.registered

    def lookup(self, token_ids: Sequence[int], **kwargs: Any) -> int:
        hit: int = _run_inline(self._loop, lambda: self._client.lookup(token_ids, **kwargs))
        return hit

    def start_lookup(self, token_ids: Sequence[int], **kwargs: Any) -> PendingLookup:
        """``lookup``, sent at the first ``result`` and answered within any later one."""
        return PendingLookup(self._loop, self._loop.create_task(
            self._client.lookup(token_ids, **kwargs)))

    def close(self) -> None:
        """Unregister and disconnect, lookups still pending cancelled; idempotent."""
        if self._loop.is_closed():
            return
        try:
            _run_inline(self._loop, self._aclose)
        finally:
            self._loop.close()

    async def _aclose(self) -> None:
        pending = asyncio.all_tasks() - {asyncio.current_task()}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._client.aclose()

    def __enter__(self) -> InlineLookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_inline(loop: asyncio.AbstractEventLoop, work: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``loop`` in this thread until ``work()`` is done."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return loop.run_until_complete(work())
    raise TransportError("InlineLookupClient called from a thread that runs an event loop: "
                         "use EngineClient there")
