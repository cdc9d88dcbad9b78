"""Lookup: how many leading tokens of a request can be loaded from the store.

One existence query for every block a hit could need, then the hybrid hit rule.
"""

from __future__ import annotations

import dataclasses

import anyio

from pipeline.errors import StoreError
from pipeline.hitrule import longest_hit, max_hit_tokens
from pipeline.messages import Lookup, LookupReply
from pipeline.sessions import EngineSession
from pipeline.store import KVStore
from stages.completion import Reply

__all__ = ["LookupRequest", "LookupStage"]

INLINE_BLOCKS = 32


@dataclasses.dataclass(frozen=True, slots=True)
class LookupRequest:
    session: EngineSession
    message: Lookup


class LookupStage:
    def __init__(self, store: KVStore, reply: Reply, limiter: anyio.CapacityLimiter) -> None:
        self._store = store
        self._reply = reply
        self._limiter = limiter

    async def hit_tokens(self, session: EngineSession, message: Lookup) -> int:
        layout = session.layout
        max_tokens = max_hit_tokens(layout, len(message.token_ids))
        if max_tokens == 0:
            return 0
        tokens = message.token_ids[:max_tokens]
        if max_tokens // layout.hash_block_size <= INLINE_BLOCKS:
            fine = session.fine_hashes(tokens, message.keys)
        else:
            fine = await anyio.to_thread.run_sync(
                session.fine_hashes, tokens, message.keys, limiter=self._limiter
            )
        group_keys = [session.group_keys(g, fine) for g in range(len(session.store_groups))]
        flat = [key for keys in group_keys for key in keys]
        try:
            exists = await self._store.exists(flat)
        except StoreError:
            return 0  # a store that cannot answer is a miss, never a wait
        available: set[tuple[int, int]] = set()
        position = 0
        for group, keys in enumerate(group_keys):
            for block in range(len(keys)):
                if exists[position]:
                    available.add((group, block))
                position += 1
        return longest_hit(layout, max_tokens, lambda g, b: (g, b) in available)

    async def process(self, request: LookupRequest) -> None:
        hit = await self.hit_tokens(request.session, request.message)
        await self._reply(request.session, LookupReply(request.message.seq, hit))
