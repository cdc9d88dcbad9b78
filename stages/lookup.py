"""Lookup: how many leading tokens of a request can be loaded from the store.

The prompt is hashed and checked in growing chunks: a miss in a full-attention group
bounds every possible hit, so a miss costs one small chunk, not the whole prompt.
Hashing runs inline (no thread hop), yielding to the event loop before a chunk that
would take the tokens hashed since it last did past what is hashed inline
(``hashed_inline``). When the engine sends its own block hashes there is nothing to
hash: a store answering in-process is asked about a first small chunk of a long
prompt, then about the rest in one query (a miss spells and checks a chunk's keys, not
the prompt's); a remote store, in one query.

Asked to explain, the stage also checks every full block of every stored group and asks
the block history why each one absent is absent.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import anyio.lowlevel

from pipeline.core.errors import StoreError
from pipeline.core.hashing import RequestHasher, group_block_hashes, hashed_inline
from pipeline.core.hitrule import longest_hit, max_hit_tokens
from pipeline.core.keys import keys_for
from pipeline.core.layout import GroupKind
from pipeline.core.messages import BlockWhy, Lookup, LookupReply, prompt_length
from pipeline.core.store import KVStore, Presence
from pipeline.state.history import BlockHistory, Prompt, Verdict, content_prints
from pipeline.state.jobs import LookupRequest, Reply
from pipeline.state.sessions import EngineSession

__all__ = ["FIRST_CHUNK_BLOCKS", "PROBE_KNOWN_ABOVE", "LookupStage"]

FIRST_CHUNK_BLOCKS = 16
"""Fine blocks hashed and checked first; each later chunk is 8x larger."""
PROBE_KNOWN_ABOVE = 256
"""Known hashes beyond this many fine blocks are checked after a first chunk, when the
store answers in-process: a query's fixed cost is worth about 200 keys' spelling and
checking (measured), so only a longer prompt is worth probing."""
_NEEDS_PREFIX = (GroupKind.FULL_ATTENTION, GroupKind.MLA_ATTENTION,
                 GroupKind.CHUNKED_LOCAL_ATTENTION)


def _leading_present(presence: Sequence[Presence]) -> int:
    """How many of these blocks, from the first, are present."""
    if presence.count(Presence.PRESENT) == len(presence):  # the usual case, in one C loop
        return len(presence)
    return next(b for b, p in enumerate(presence) if p is not Presence.PRESENT)


_NONE: Mapping[str, int] = {}


class LookupStage:
    def __init__(
        self, store: KVStore, value_sizes: Mapping[str, Mapping[str, int]],
        history: BlockHistory | None = None, *, probe_first: bool = False,
        where: Callable[[str], str] | None = None,
    ) -> None:
        """``value_sizes``: per tenant, the stored bytes of a value under each key
        prefix, as its engines registered them; a key under a prefix of unknown size is
        a miss.
        ``history`` explains absent blocks (without it every absent block is
        never_stored). ``probe_first``: the store answers in-process, so a query costs
        its keys, not a round trip: a long prompt's known hashes are probed first.
        ``where``: where the store keeps a present block's value, for explanations."""
        self._store = store
        self._value_sizes = value_sizes
        self._history = history or BlockHistory(0)
        self._probe_first = probe_first
        self._where = where

    async def hit_tokens(self, session: EngineSession, message: Lookup) -> int:
        bound = max_hit_tokens(session.layout, prompt_length(message))
        hasher: RequestHasher | None = None
        if message.block_hashes is None:
            hasher = (
                session.new_hasher(message.keys) if message.request_id is None
                else session.take_hasher(message.request_id, message.keys, message.token_ids)
            )
        try:
            return await self._hit_tokens(session, message, hasher, bound)
        finally:
            if hasher is not None and message.request_id is not None:
                session.keep_hasher(message.request_id, message.keys, hasher,
                                    message.token_ids)

    async def _hit_tokens(
        self, session: EngineSession, message: Lookup, hasher: RequestHasher | None,
        bound: int,
    ) -> int:
        layout = session.layout
        hbs = layout.hash_block_size
        groups = session.store_groups
        value_sizes = self._value_sizes.get(session.tenant, _NONE)
        # When every group needs an unbroken prefix (dense models), the first misses bound
        # the hit and nothing else matters: no per-block presence is kept.
        prefix_only = all(geometry.group.kind in _NEEDS_PREFIX for geometry in groups)
        present: list[list[bool]] = [[] for _ in groups]  # of store group g, blocks 0..n-1
        checked = [0] * len(groups)  # blocks of each store group looked at so far
        done = 0  # fine blocks hashed and checked
        # Hashes already known (the engine's, or a repeated request's) are checked in one
        # query; of a long prompt, after a first chunk, where a query costs only its keys.
        known = len(message.block_hashes or ()) if hasher is None else len(hasher.hashes)
        probe = self._probe_first and known > PROBE_KNOWN_ABOVE
        chunk = FIRST_CHUNK_BLOCKS if probe else max(FIRST_CHUNK_BLOCKS, known)
        unyielded = 0  # fine blocks hashed since the event loop last ran others
        while done * hbs < bound:
            end = min(bound // hbs, done + chunk)
            if hasher is not None:
                fresh = max(0, end - len(hasher.hashes))  # blocks this chunk hashes
                if unyielded and not hashed_inline((unyielded + fresh) * hbs, message.keys):
                    await anyio.lowlevel.checkpoint()  # let others run between chunks
                    unyielded = 0
                unyielded += fresh
                fine: Sequence[bytes] = hasher.extend(message.token_ids[: end * hbs])
            else:
                fine = message.block_hashes  # type: ignore[assignment]
            # Blocks of each store group that end inside the new chunk of fine blocks.
            # Every rank namespace must hold a block (each rank loads its own shard).
            spelled: list[list[str]] = []
            sizes: list[int] = []
            counts: list[int] = []
            for geometry in groups:
                size = geometry.group.block_size
                k = size // hbs
                new = group_block_hashes(fine[done // k * k : end // k * k], hbs, size)
                for prefix in geometry.keys.lookup:
                    spelled.append(session.speller.run_keys(prefix, new))
                    sizes.extend([value_sizes.get(prefix, 0)] * len(new))
                counts.append(len(new))
            # One group in one rank namespace (the usual case) is the whole query: its
            # keys as spelled, and the answer taken unsliced.
            whole = len(spelled) == 1
            keys = spelled[0] if whole else list(itertools.chain(*spelled))
            try:
                exists = await self._store.exists(keys, sizes)
            except StoreError:
                return 0  # a store that cannot answer is a miss, never a wait
            start = 0
            for g, (geometry, count) in enumerate(zip(groups, counts, strict=True)):
                shards = [exists] if whole else [
                    exists[start + shard * count : start + (shard + 1) * count]
                    for shard in range(len(geometry.keys.lookup))]
                start += count * len(shards)
                run = count  # of these blocks, how many from the first are present
                if prefix_only:
                    run = min(_leading_present(shard) for shard in shards)
                else:
                    found = [p is Presence.PRESENT for p in shards[0]]
                    for other in shards[1:]:  # every rank namespace must hold the block
                        found = [a and p is Presence.PRESENT
                                 for a, p in zip(found, other, strict=True)]
                    present[g].extend(found)
                    if geometry.group.kind in _NEEDS_PREFIX and not all(found):
                        run = found.index(False)
                if run < count:
                    bound = min(bound, (checked[g] + run) * geometry.group.block_size)
                checked[g] += count
            done = end
            chunk = max(chunk * 8, known - done)
        if prefix_only:
            align = layout.lookup_alignment
            return bound // align * align
        return longest_hit(
            layout, bound, lambda g, b: b < len(present[g]) and present[g][b]
        )

    async def explain(self, session: EngineSession, message: Lookup) -> tuple[BlockWhy, ...]:
        """Every full block of every stored group: present, or why not. (Rarely asked:
        the prompt is hashed at once, not chunk by chunk as a lookup does.)"""
        value_sizes = self._value_sizes.get(session.tenant, _NONE)
        hbs = session.layout.hash_block_size
        tokens = message.token_ids
        fine = (message.block_hashes if message.block_hashes is not None
                else session.new_hasher(message.keys).extend(tokens))
        blocks: list[tuple[int, int, bytes, int]] = []  # (store group, block, hash, key index)
        keys: list[str] = []
        sizes: list[int] = []
        for g, geometry in enumerate(session.store_groups):
            k = geometry.group.block_size // hbs
            hashes = group_block_hashes(fine[: len(fine) // k * k], hbs, geometry.group.block_size)
            for j, block_hash in enumerate(hashes):
                blocks.append((g, j, block_hash, len(keys)))
                for prefix in geometry.keys.lookup:
                    keys.extend(keys_for(prefix, (block_hash,)))
                    sizes.append(value_sizes.get(prefix, 0))
        try:
            presence = await self._store.exists(keys, sizes)
        except StoreError as exc:
            return tuple(BlockWhy(session.store_groups[g].kv_group_id, j, h, Verdict.UNKNOWN,
                                  f"the store cannot say: {exc}") for g, j, h, _ in blocks)
        ends = [(j + 1) * session.store_groups[g].group.block_size for g, j, _, _ in blocks]
        prompt = Prompt(tokens, content_prints(tokens, ends), min(ends)) if (
            len(tokens) and ends) else None
        explained = []
        for (g, j, block_hash, at), end in zip(blocks, ends, strict=True):
            geometry = session.store_groups[g]
            # Every rank namespace must hold the block: the first that does not, says why.
            shard = next((s for s in range(len(geometry.keys.lookup))
                          if presence[at + s] is not Presence.PRESENT), 0)
            verdict, reason, age_s = self._history.why(
                keys[at + shard], geometry.keys.lookup[shard], (g, block_hash),
                presence[at + shard], message.keys, prompt, end, tenant=session.tenant)
            if verdict is Verdict.PRESENT and self._where is not None:
                reason = self._where(keys[at + shard])
            explained.append(BlockWhy(geometry.kv_group_id, j, block_hash, verdict, reason,
                                      round(age_s, 3)))
        return tuple(explained)

    async def process(self, request: LookupRequest) -> Reply:
        session, message = request.session, request.message
        hit = await self.hit_tokens(session, message)
        explained = await self.explain(session, message) if message.explain else None
        return Reply(session, LookupReply(message.seq, hit, explain=explained), request)
