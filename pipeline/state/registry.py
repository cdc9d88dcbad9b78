"""Registration: turning an engine's Register message into a session, failing closed.

A session belongs to the identity that registered it, on the connection it registered
on, and within that identity's tenant: the tenant's key prefix, where it has one, is
forced on the layout (a peer cannot name another tenant's namespace), and an engine id
is the registering identity's own (the same id under another identity is another
engine). Registering again under the same identity and engine id, from any connection,
replaces the old session: that is how an engine resumes after a reconnect.

Order matters: the layout and the config's limits are checked before any tensor is
touched, the hash self-test (at most two hash blocks) runs before anything is mapped, and
only the stored groups' layers are ever mapped, in a worker thread, within the memory
budget the limits leave. Whatever fails after mapping unmaps again: a refused or failed
registration leaves the registry as it found it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import msgspec
import torch

from pipeline.core.config import LimitsConfig
from pipeline.core.errors import LayoutError, LimitExceeded, RequestRejected, TransportError
from pipeline.core.geometry import StoreGroupGeometry, build_lookup_groups, build_store_groups
from pipeline.core.hashing import block_hashes
from pipeline.core.keys import ValueFormat
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import (
    HASH_ALGOS,
    PROTOCOL_VERSION,
    SIDECAR_HASH_ALGO,
    CudaIpcEvent,
    ErrorCode,
    Register,
    Registered,
    TensorHandle,
)
from pipeline.core.tenancy import Peer, Tenancy, Tenant
from pipeline.state.sessions import EngineSession, TensorMapping

__all__ = ["Handed", "LayerTensors", "MapTensors", "MappingBudget", "SessionRegistry"]

LayerTensors = dict[str, tuple[torch.Tensor, int]]


@dataclasses.dataclass(frozen=True)
class MappingBudget:
    """The most bytes one registration may map, and the limit that sets it."""

    max_bytes: int
    limit: str


class Handed(Protocol):
    """Memory files an engine handed over: whoever holds them closes them."""

    def close(self) -> None: ...


MapTensors = Callable[
    [Sequence[TensorHandle], MappingBudget, Peer, "Handed | None"],
    tuple[LayerTensors, TensorMapping],
]
"""Maps handles to ``{layer: (tensor, block_dim)}``, with the mapping that holds them,
refusing (``LimitExceeded``) segments past the budget before mapping them. CPU handles
name memory files in what the engine handed over, which the mapping then owns; GPU
handles must be the peer's own where the transport knows its pid. It may block: it runs
in a worker thread."""


class SessionRegistry:
    def __init__(
        self,
        map_tensors: MapTensors,
        *,
        checksum: bool = True,
        value_format: ValueFormat = ValueFormat.NATIVE,
        max_value_bytes: int,
        save_capacity_blocks: Callable[[int], int],
        open_step_event: Callable[[CudaIpcEvent], torch.cuda.Event] | None = None,
        prepare_copies: Callable[[tuple[StoreGroupGeometry, ...]], None] | None = None,
        limits: LimitsConfig | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        """``tenancy``: the tenant of each identity (None: one tenant).
        ``open_step_event``: opens an engine's step event; None: GPU tensors are
        not served (the copies are CPU threads). ``prepare_copies``: told the store
        groups of each engine registered with tensors, to ready what their copies need
        (it must return at once)."""
        self._map_tensors = map_tensors
        self._open_step_event = open_step_event
        self._prepare_copies = prepare_copies
        self._checksum = checksum
        self._value_format = value_format
        self._max_value_bytes = max_value_bytes
        self._save_capacity_blocks = save_capacity_blocks
        self._limits = limits or LimitsConfig()
        self._tenancy = tenancy or Tenancy({}, ())
        self._registering = anyio.Lock()
        """One registration at a time: each maps within what the others left."""
        self.sessions: dict[bytes, EngineSession] = {}
        """By connection (routing id)."""
        self.value_sizes: dict[str, dict[str, int]] = {}
        """Per tenant, the stored bytes of a value under each key prefix an engine
        registered tensors for: what a lookup of that prefix expects (a lookup-only
        engine has no tensors)."""

    def get(self, connection: bytes, peer: Peer) -> EngineSession | None:
        """The session registered on ``connection``, if ``peer`` registered it."""
        session = self.sessions.get(connection)
        if session is None or session.peer.principal != peer.principal:
            return None
        return session

    def find(self, engine_id: str, peer: Peer) -> EngineSession:
        """The session ``peer`` may see registered as ``engine_id`` ("": the only such
        engine that saves and loads, if there is exactly one): its own tenant's, or any
        for an operator. Nothing else is told."""
        operator = self._tenancy.is_operator(peer.principal)
        tenant = self._tenancy.tenant_of(peer.principal).name
        sessions = [s for s in self.sessions.values()
                    if (operator or s.tenant == tenant)
                    and (s.engine_id == engine_id or (not engine_id and not s.lookup_only))]
        if len(sessions) == 1:
            return sessions[0]
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            "no engine of that id is registered in this tenant" if engine_id
            else "not exactly one engine that saves and loads is registered in this tenant")

    async def register(
        self, connection: bytes, peer: Peer, message: Register, handed: Handed | None = None
    ) -> tuple[EngineSession, Registered]:
        """Create (or replace) the session of ``peer``'s engine on ``connection``.
        ``handed``: the memory files the engine handed over, now the registry's."""
        try:
            async with self._registering:
                registered = await self._register(connection, peer, message, handed)
        except BaseException:
            if handed is not None:
                handed.close()
            raise
        if handed is not None and message.lookup_only:
            handed.close()  # else the session's mapping holds what it mapped
        return registered

    async def _register(
        self, connection: bytes, peer: Peer, message: Register, handed: Handed | None
    ) -> tuple[EngineSession, Registered]:
        if message.version != PROTOCOL_VERSION:
            raise RequestRejected(
                ErrorCode.BAD_VERSION,
                f"protocol version {message.version} is not supported "
                f"(expected {PROTOCOL_VERSION}): upgrade the engine's kvsidecar",
            )
        tenant = self._tenancy.tenant_of(peer.principal)
        layout = self._tenant_layout(tenant, message.layout)
        try:
            layout.validate_for_store()
        except LayoutError as exc:
            raise RequestRejected(ErrorCode.BAD_LAYOUT, str(exc)) from exc
        replaced = self._replaced(connection, peer, message.engine_id)
        self._check_limits(replaced, layout)
        if message.hash_algo not in HASH_ALGOS:
            raise RequestRejected(
                ErrorCode.BAD_LAYOUT,
                f"hash_algo {message.hash_algo!r} is not one of {', '.join(HASH_ALGOS)}",
            )
        if message.hash_algo == SIDECAR_HASH_ALGO:
            self._self_test(layout, message)
        if message.lookup_only:
            store_groups, mapping = self._lookup_groups(layout, message)
        else:
            store_groups, mapping = await self._mapped_groups(
                replaced, tenant, peer, layout, message, handed)
        try:
            if self._prepare_copies is not None and not message.lookup_only:
                self._prepare_copies(store_groups)
            session = EngineSession(
                message.engine_id,
                connection,
                layout,
                store_groups,
                hash_seed=message.hash_seed,
                engine_hashes_only=message.hash_algo != SIDECAR_HASH_ALGO,
                lookup_only=message.lookup_only,
                mapping=mapping,
                peer=peer,
                tenant=tenant.name,
            )
            capacity = 0 if message.lookup_only else min(
                self._save_capacity_blocks(g.stored_bytes) for g in store_groups
            )
            reply = Registered(
                engine_id=message.engine_id,
                hash_block_size=layout.hash_block_size,
                lookup_alignment=layout.lookup_alignment,
                store_group_ids=layout.prefix_cacheable_group_ids,
                layout_fingerprint=layout.fingerprint,
                save_capacity_blocks=capacity,
                value_format=str(self._value_format),
            )
        except BaseException:
            if mapping is not None:
                mapping.close()
            raise
        for old_connection in replaced:
            self.remove(old_connection)
        self.sessions[connection] = session
        return session, reply

    def _tenant_layout(self, tenant: Tenant, layout: KVCacheLayout) -> KVCacheLayout:
        """``layout`` in ``tenant``'s key namespace: its prefix forced, where it has one."""
        if tenant.key_prefix is None or layout.cache_prefix == tenant.key_prefix:
            return layout
        if layout.cache_prefix:
            raise RequestRejected(
                ErrorCode.BAD_LAYOUT,
                f"cache_prefix {layout.cache_prefix!r} is not this tenant's: its key "
                "prefix is set by the sidecar's config (leave cache_prefix empty)")
        return msgspec.structs.replace(layout, cache_prefix=tenant.key_prefix)

    def _replaced(self, connection: bytes, peer: Peer, engine_id: str) -> set[bytes]:
        """The connections whose sessions a registration replaces: its own connection's,
        and its identity's session of the same engine id on any other."""
        replaced = {connection} & self.sessions.keys()
        replaced.update(key for key, s in self.sessions.items()
                        if s.peer.principal == peer.principal and s.engine_id == engine_id)
        return replaced

    def _lookup_groups(
        self, layout: KVCacheLayout, message: Register
    ) -> tuple[tuple[StoreGroupGeometry, ...], None]:
        """Store groups of a session that only looks up: keys and hit rule, no memory."""
        if message.tensors:
            raise RequestRejected(
                ErrorCode.BAD_TENSORS, "a lookup-only registration must not share tensors"
            )
        return build_lookup_groups(layout, self._value_format), None

    def _check_limits(self, replaced: set[bytes], layout: KVCacheLayout) -> None:
        """Refuse a layout or a new session past the config's limits."""
        limits = self._limits
        if not replaced and len(self.sessions) >= limits.max_engines:
            raise LimitExceeded(
                "limits.max_engines",
                f"{len(self.sessions)} engines are registered, the most this sidecar serves",
            )
        largest = max(max(g.block_size for g in layout.groups), layout.hash_block_size)
        if largest > limits.max_block_tokens:
            raise LimitExceeded(
                "limits.max_block_tokens",
                f"a block or hash block of {largest} tokens is larger than this sidecar "
                f"takes ({limits.max_block_tokens})",
            )

    def _budget(self, replaced: set[bytes]) -> MappingBudget:
        """What a registration may map: its engine's share, or what the other sessions
        leave of the total (the sessions it replaces give theirs back)."""
        limits = self._limits
        others = sum(session.mapped_bytes for key, session in self.sessions.items()
                     if key not in replaced)
        left = limits.total_mapped() - others
        if left < limits.engine_mapped():
            return MappingBudget(max(0, left), "limits.total_mapped_bytes")
        return MappingBudget(limits.engine_mapped(), "limits.engine_mapped_bytes")

    async def _mapped_groups(
        self, replaced: set[bytes], tenant: Tenant, peer: Peer, layout: KVCacheLayout,
        message: Register, handed: Handed | None,
    ) -> tuple[tuple[StoreGroupGeometry, ...], TensorMapping]:
        payload = {layer for layers in layout.payload_layers for layer in layers}
        # Tensors of groups that are not stored (the ring) are never mapped or read.
        wanted = [handle for handle in message.tensors if handle.layer in payload]
        on_gpu = next((handle for handle in wanted if handle.device != "cpu"), None)
        if on_gpu is not None and self._open_step_event is None:
            raise RequestRejected(
                ErrorCode.BAD_TENSORS,
                f"layer {on_gpu.layer!r} is on {on_gpu.device}, and this sidecar copies "
                "with CPU threads (store.engine_memory: cpu, which sets "
                "stages.transfer.device)",
            )
        try:
            # Mapping populates page tables in proportion to the engine's memory: off the
            # event loop. Not abandoned on cancellation: the thread's mapping is closed.
            tensors, mapping = await anyio.to_thread.run_sync(
                self._map_tensors, wanted, self._budget(replaced), peer, handed)
        except TransportError as exc:
            raise RequestRejected(ErrorCode.BAD_TENSORS, str(exc)) from exc
        try:
            store_groups = build_store_groups(
                layout, tensors, checksum=self._checksum, value_format=self._value_format,
                tenant=tenant.name,
            )
            if message.step_event is not None and self._open_step_event is not None:
                event = self._open_step_event(message.step_event)
                store_groups = tuple(dataclasses.replace(g, step_event=event)
                                     for g in store_groups)
            for geometry in store_groups:
                if geometry.stored_bytes > self._max_value_bytes:
                    raise LayoutError(
                        f"group {geometry.kv_group_id}: one block is {geometry.stored_bytes} "
                        f"bytes, more than a staging slot ({self._max_value_bytes}); raise "
                        "staging.slot_bytes"
                    )
        except (LayoutError, TransportError) as exc:
            mapping.close()
            raise RequestRejected(ErrorCode.BAD_TENSORS, str(exc)) from exc
        except BaseException:
            mapping.close()
            raise
        self.value_sizes.setdefault(tenant.name, {}).update(
            (g.key_prefix, g.stored_bytes) for g in store_groups)
        return store_groups, mapping

    def _self_test(self, layout: KVCacheLayout, message: Register) -> None:
        test = message.self_test
        if len(test.token_ids) > 2 * layout.hash_block_size:
            raise RequestRejected(
                ErrorCode.HASH_MISMATCH,
                f"a self-test of {len(test.token_ids)} tokens is longer than two hash blocks "
                f"(hash_block_size={layout.hash_block_size})",
            )
        expected = block_hashes(test.token_ids, layout.hash_block_size, seed=message.hash_seed)
        if len(expected) == 0 or list(test.block_hashes) != expected:
            raise RequestRejected(
                ErrorCode.HASH_MISMATCH,
                f"the engine's block hashes of the self-test sequence differ from the "
                f"sidecar's (hash_block_size={layout.hash_block_size}, "
                f"seed={'default' if message.hash_seed is None else 'PYTHONHASHSEED'}); "
                "check the hash function (sha256_cbor) and PYTHONHASHSEED",
            )

    def remove(self, connection: bytes) -> EngineSession | None:
        session = self.sessions.pop(connection, None)
        if session is not None:
            session.close()
        return session

    def close(self) -> None:
        for connection in list(self.sessions):
            self.remove(connection)
