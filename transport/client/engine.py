"""An engine's async client: register its layout and KV tensors, then look up, save
and load.

An engine allocates its KV tensors with ``transport.tensors.shared_kv_tensor``, connects
with its layout and tensors, then sends scheduler events. A save or load carries its
deadline (now plus its timeout); an engine may reuse a request's blocks once its call is
over, whatever happened (``transport.client.wire``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

import anyio
import anyio.from_thread
import msgspec
import torch
import zmq
import zmq.asyncio
from anyio.abc import AsyncResource

from pipeline.core.errors import RequestRejected, TransportError
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import (
    SIDECAR_HASH_ALGO,
    EngineMessage,
    ErrorCode,
    ErrorReply,
    Explain,
    Handover,
    HandoverTicket,
    Heartbeat,
    Load,
    LoadDone,
    LookupReply,
    Register,
    Registered,
    Save,
    SaveDone,
    SidecarMessage,
    Unregister,
    pack_tokens,
)
from transport.client.registration import BlockHasher, KVCacheShape, Registration
from transport.client.results import (
    Explanation,
    LoadResult,
    SaveResult,
    blocks_of,
    hashes,
    keys_of,
    lookup_message,
    overloaded,
)
from transport.client.wire import Conversation, open_socket
from transport.handover import hand_over
from transport.tensors import Segments

__all__ = ["LOOKUP_SPIN_S", "BlockHasher", "EngineClient", "KVCacheShape"]

LOOKUP_SPIN_S = 0.001
"""``EngineClient.connect``'s default ``lookup_spin_s``."""


class EngineClient(Conversation, AsyncResource):
    """An engine's connection to a sidecar. Use ``await EngineClient.connect(...)``."""

    def __init__(self, socket: zmq.asyncio.Socket, context: zmq.asyncio.Context,
                 timeout_s: float, *, curve: bool = False, endpoint: str = "") -> None:
        super().__init__(socket, context, timeout_s, curve=curve, endpoint=endpoint)
        self.lookup_spin_s = LOOKUP_SPIN_S
        """How long a lookup polls for its reply (``connect``'s ``lookup_spin_s``)."""
        self._register_lock = anyio.Lock()
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
        registration = Registration.of(
            layout, kv_caches, engine_id=engine_id, kv_cache_shape=kv_cache_shape,
            hash_seed=hash_seed, block_hasher=block_hasher, hash_algo=hash_algo,
            lookup_only=lookup_only, share_in_place=share_in_place)
        client = cls._connect(endpoint, timeout_s, curve_server_key, curve_key_pair)
        client.lookup_spin_s = lookup_spin_s
        client._step = registration.step
        client._segments = registration.segments
        client._registration = registration.message
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
        socket, context = open_socket(endpoint, curve_server_key, curve_key_pair)
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
                1, engine_id, pack_tokens(list(token_ids)), keys_of(**request_keys),
                hashes(block_hashes)))
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
            keys=keys_of(**request_keys), block_hashes=block_hashes,
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
                overloaded(request_id, block_ids, self.registered.store_group_ids),
                shed=True)
        if mark_step:
            self.mark_step()
        seq = next(self._seq)
        message = Save(seq, request_id, pack_tokens(token_ids), blocks_of(block_ids),
                       keys_of(**request_keys), hashes(block_hashes),
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
        message = Load(seq, request_id, pack_tokens(token_ids), blocks_of(block_ids), num_tokens,
                       keys_of(**request_keys), hashes(block_hashes), computed_tokens,
                       deadline=self._deadline(timeout_s))
        reply = await self._call(seq, message, timeout_s)
        assert isinstance(reply, LoadDone)
        return LoadResult(reply.loaded_tokens, reply.invalid_block_ids, reply.blocks)

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
        self._close()

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
