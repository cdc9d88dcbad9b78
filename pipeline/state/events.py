"""The sidecar's KV events as they happen: blocks stored, removed, all cleared.

Stages and the store report here, on the event loop; a publisher drains the events in
batches (``transport.events``). The queue is bounded: past ``events.max_pending`` an
event is dropped and counted, never waited for.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from pipeline.core.config import EventsConfig
from pipeline.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
)
from pipeline.core.keys import parse_key
from pipeline.state.jobs import BlockTask

__all__ = ["KVEventLog"]

log = structlog.get_logger("kvsidecar.events")


MAX_SHAPES = 4096
"""Key prefixes whose shape ``KVEventLog`` remembers: engines x groups x ranks."""


class KVEventLog:
    def __init__(self, config: EventsConfig) -> None:
        self.enabled = bool(config.endpoint)
        self._config = config
        self._as_int = config.hash_format == "int"
        self._send, receive = anyio.create_memory_object_stream[KVCacheEvent](
            max_buffer_size=config.max_pending
        )
        self.pending: MemoryObjectReceiveStream[KVCacheEvent] = receive
        """What the publisher drains."""
        self.dropped = 0
        self._shapes: dict[str, tuple[int, str | None, int | None]] = {}
        """Block size, kind and window of each key prefix saved under (``moved``)."""

    def stored(self, tasks: Sequence[BlockTask]) -> None:
        """Blocks just stored, one event each (as vLLM's store connector sends them)."""
        if not self.enabled:
            return
        for task in tasks:
            group = task.geometry.group
            message = task.job.message
            prefix = task.key.rpartition("@")[0]
            if prefix not in self._shapes and len(self._shapes) < MAX_SHAPES:
                self._shapes[prefix] = (group.block_size, str(group.kind), group.sliding_window)
            tokens: list[int] = []
            if self._config.include_token_ids:
                start = task.block_index * group.block_size
                tokens = list(message.token_ids[start : start + group.block_size])
            self._put(BlockStored(
                block_hashes=[self._hash(task.block_hash)],
                parent_block_hash=(
                    None if task.parent_hash is None else self._hash(task.parent_hash)
                ),
                token_ids=tokens,
                block_size=group.block_size,
                lora_id=None,
                medium=self._config.medium,
                lora_name=message.keys.lora_name,
                group_idx=task.store_group,
                kv_cache_spec_kind=str(group.kind),
                kv_cache_spec_sliding_window=group.sliding_window,
            ))

    def removed(self, keys: Sequence[str]) -> None:
        """Keys removed from the store after failing integrity (medium ``events.medium``)."""
        self.moved(keys, "memory", False)

    def moved(self, keys: Sequence[str], medium: str, present: bool) -> None:
        """Keys that arrived in (``present``) or left a medium of the store: ``memory``
        (named ``events.medium``) or ``disk``. A block announced present carries the
        block size and kind its group had when an engine first saved under its key
        prefix in this process, or 0 and none if none has."""
        if self.enabled:
            for key in keys:
                event = self._medium_event(key, medium, present)
                if event is not None:
                    self._put(event)

    async def announce(self, keys: Sequence[str], medium: str) -> None:
        """``moved(keys, medium, True)``, waiting for the publisher where the queue is
        full instead of dropping: what a start finds in the store, however much."""
        if self.enabled:
            for key in keys:
                event = self._medium_event(key, medium, True)
                if event is not None:
                    await self._send.send(event)

    def _medium_event(self, key: str, medium: str, present: bool) -> KVCacheEvent | None:
        parsed = parse_key(key)
        if parsed is None:
            return None
        group, block_hash = parsed
        name = self._config.medium if medium == "memory" else medium
        if not present:
            return BlockRemoved([self._hash(block_hash)], medium=name, group_idx=group)
        block_size, kind, window = self._shapes.get(key.rpartition("@")[0], (0, None, None))
        return BlockStored(
            block_hashes=[self._hash(block_hash)], parent_block_hash=None, token_ids=[],
            block_size=block_size, lora_id=None, medium=name, lora_name=None,
            group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)

    def cleared(self) -> None:
        if self.enabled:
            self._put(AllBlocksCleared())

    def _hash(self, block_hash: bytes) -> int | bytes:
        return external_hash(block_hash, as_int=self._as_int)

    def _put(self, event: KVCacheEvent) -> None:
        try:
            self._send.send_nowait(event)
        except anyio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10000 == 0:
                log.warning("events.dropped", dropped=self.dropped,
                            max_pending=self._config.max_pending)
