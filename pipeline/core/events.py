"""KV events on the wire, as vLLM 0.33's ``ZmqEventPublisher`` sends them.

Each PUB message is ``[topic, seq (8 bytes, big-endian), msgpack EventBatch]``; the
structs below encode to the same bytes as vLLM's own (``vllm.distributed.kv_events``),
so routers that index vLLM's events (llm-d, Dynamo, Mooncake Conductor) read ours.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "external_hash",
]

ExternalHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    # vLLM's fields, their order and their defaults, even those kvsidecar never sets:
    # they decide the encoded bytes (msgspec sizes the map header by the field count).
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def external_hash(block_hash: bytes, *, as_int: bool) -> ExternalHash:
    """A block hash as vLLM publishes it: its low 64 bits as an int, or the digest."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1) if as_int else block_hash
