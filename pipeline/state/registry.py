"""Registration: turning an engine's Register message into a session, failing closed.

Order matters: the layout and the config's limits are checked before any tensor is
touched, the hash self-test (at most two hash blocks) runs before anything is mapped, and
only the stored groups' layers are ever mapped, in a worker thread, within the memory
budget the limits leave. Whatever fails after mapping unmaps again: a refused or failed
registration leaves the registry as it found it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import anyio
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
from pipeline.state.sessions import EngineSession, TensorMapping

__all__ = ["LayerTensors", "MapTensors", "MappingBudget", "SessionRegistry"]

LayerTensors = dict[str, tuple[torch.Tensor, int]]


@dataclasses.dataclass(frozen=True)
class MappingBudget:
    """The most bytes one registration may map, and the limit that sets it."""

    max_bytes: int
    limit: str


MapTensors = Callable[
    [Sequence[TensorHandle], MappingBudget], tuple[LayerTensors, TensorMapping]
]
"""Maps handles to ``{layer: (tensor, block_dim)}``, with the mapping that holds them,
refusing (``LimitExceeded``) segments past the budget before mapping them. It may block:
it runs in a worker thread."""


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
    ) -> None:
        """``open_step_event``: opens an engine's step event; None: GPU tensors are
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
        self._registering = anyio.Lock()
        """One registration at a time: each maps within what the others left."""
        self.sessions: dict[bytes, EngineSession] = {}
        self.value_sizes: dict[str, int] = {}
        """Stored bytes of a value under each key prefix an engine registered tensors
        for: what a lookup of that prefix expects (a lookup-only engine has no tensors)."""

    def get(self, identity: bytes) -> EngineSession | None:
        return self.sessions.get(identity)

    def find(self, engine_id: str) -> EngineSession:
        """The session of the engine registered as ``engine_id`` ("": the only engine
        registered that saves and loads, if there is exactly one)."""
        sessions = [s for s in self.sessions.values()
                    if s.engine_id == engine_id or (not engine_id and not s.lookup_only)]
        if len(sessions) == 1:
            return sessions[0]
        registered = sorted(s.engine_id for s in self.sessions.values())
        wanted = f"engine {engine_id!r}" if engine_id else "exactly one engine"
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"{wanted} is not registered; registered: {', '.join(registered) or 'none'}")

    async def register(
        self, identity: bytes, message: Register
    ) -> tuple[EngineSession, Registered]:
        """Create (or idempotently replace) the session of ``identity``."""
        async with self._registering:
            return await self._register(identity, message)

    async def _register(
        self, identity: bytes, message: Register
    ) -> tuple[EngineSession, Registered]:
        if message.version != PROTOCOL_VERSION:
            raise RequestRejected(
                ErrorCode.BAD_VERSION,
                f"protocol version {message.version} is not supported "
                f"(expected {PROTOCOL_VERSION})",
            )
        layout = message.layout
        try:
            layout.validate_for_store()
        except LayoutError as exc:
            raise RequestRejected(ErrorCode.BAD_LAYOUT, str(exc)) from exc
        self._check_limits(identity, layout)
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
            store_groups, mapping = await self._mapped_groups(identity, layout, message)
        try:
            if self._prepare_copies is not None and not message.lookup_only:
                self._prepare_copies(store_groups)
            session = EngineSession(
                message.engine_id,
                identity,
                layout,
                store_groups,
                hash_seed=message.hash_seed,
                engine_hashes_only=message.hash_algo != SIDECAR_HASH_ALGO,
                lookup_only=message.lookup_only,
                mapping=mapping,
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
            )
        except BaseException:
            if mapping is not None:
                mapping.close()
            raise
        old = self.sessions.pop(identity, None)
        if old is not None:
            old.close()
        self.sessions[identity] = session
        return session, reply

    def _lookup_groups(
        self, layout: KVCacheLayout, message: Register
    ) -> tuple[tuple[StoreGroupGeometry, ...], None]:
        """Store groups of a session that only looks up: keys and hit rule, no memory."""
        if message.tensors:
            raise RequestRejected(
                ErrorCode.BAD_TENSORS, "a lookup-only registration must not share tensors"
            )
        return build_lookup_groups(layout, self._value_format), None

    def _check_limits(self, identity: bytes, layout: KVCacheLayout) -> None:
        """Refuse a layout or a new session past the config's limits."""
        limits = self._limits
        if identity not in self.sessions and len(self.sessions) >= limits.max_engines:
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

    def _budget(self, identity: bytes) -> MappingBudget:
        """What a registration of ``identity`` may map: its engine's share, or what the
        other sessions leave of the total (its own old session's mapping is replaced)."""
        limits = self._limits
        others = sum(session.mapped_bytes for key, session in self.sessions.items()
                     if key != identity)
        left = limits.total_mapped() - others
        if left < limits.engine_mapped():
            return MappingBudget(max(0, left), "limits.total_mapped_bytes")
        return MappingBudget(limits.engine_mapped(), "limits.engine_mapped_bytes")

    async def _mapped_groups(
        self, identity: bytes, layout: KVCacheLayout, message: Register
    ) -> tuple[tuple[StoreGroupGeometry, ...], TensorMapping]:
        payload = {layer for layers in layout.payload_layers for layer in layers}
        # Tensors of groups that are not stored (the ring) are never mapped or read.
        wanted = [handle for handle in message.tensors if handle.layer in payload]
        on_gpu = next((handle for handle in wanted if handle.device != "cpu"), None)
        if on_gpu is not None and self._open_step_event is None:
            raise RequestRejected(
                ErrorCode.BAD_TENSORS,
                f"layer {on_gpu.layer!r} is on {on_gpu.device}, and this sidecar copies "
                "with CPU threads (stages.transfer.device: cpu)",
            )
        try:
            # Mapping populates page tables in proportion to the engine's memory: off the
            # event loop. Not abandoned on cancellation: the thread's mapping is closed.
            tensors, mapping = await anyio.to_thread.run_sync(
                self._map_tensors, wanted, self._budget(identity))
        except TransportError as exc:
            raise RequestRejected(ErrorCode.BAD_TENSORS, str(exc)) from exc
        try:
            store_groups = build_store_groups(
                layout, tensors, checksum=self._checksum, value_format=self._value_format
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
        self.value_sizes.update((g.key_prefix, g.stored_bytes) for g in store_groups)
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

    def remove(self, identity: bytes) -> EngineSession | None:
        session = self.sessions.pop(identity, None)
        if session is not None:
            session.close()
        return session

    def close(self) -> None:
        for identity in list(self.sessions):
            self.remove(identity)
