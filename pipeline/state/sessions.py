"""Engine sessions: a registered engine's layout, mapped KV tensors and hashing state."""

from __future__ import annotations

import array
import collections
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
import structlog

from pipeline.core.errors import ProtocolError
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.hashing import RequestHasher, group_block_hashes, uint32_tokens
from pipeline.core.keys import KeySpeller
from pipeline.core.layout import NULL_BLOCK_ID, KVCacheLayout
from pipeline.core.messages import (
    TOKEN_BYTES,
    TOKEN_TYPECODE,
    RequestKeys,
    compact_keys,
    keys_size,
)
from pipeline.core.tenancy import Peer

__all__ = ["EngineSession", "TensorMapping"]

HASHER_CACHE_SIZE = 4096
HASHER_CACHE_BYTES = 16 << 20
"""The most bytes a session's kept hash chains hold (tokens, hashes, request keys
kept by digest when large), whatever their number."""
FIRST_HASH_CACHE_SIZE = 1024
"""First blocks whose hash a session remembers (``EngineSession.first_block_hash``): at
most a hash block of tokens each, as uint32 bytes, with request keys kept by digest when
large."""


class _KeptChain(msgspec.Struct, frozen=True, gc=False):
    """A request's hash chain, kept for its next call.

    Untracked by the cycle collector, and made of what it never tracks (bytes, request
    keys of strings): under load the cache is rewritten between two collections, and a
    cached ``RequestHasher`` with its lists and token array was some six tracked objects
    a request, all walked by each young collection (about half of the 45-80k objects
    each one walked under a flood)."""

    keys: RequestKeys
    hashes: bytes
    """The chain's hashes, back to back (``RequestHasher.chain``)."""
    mm_next: int
    seen: bytes
    """The tokens hashed, as uint32s: the request's next call must begin with them."""
    cost: int
    """What it counts against ``HASHER_CACHE_BYTES``."""


def _token_bytes(token_ids: Sequence[int], count: int) -> bytes | None:
    """The first ``count`` tokens as uint32 bytes; None when one is out of that range."""
    tokens = uint32_tokens(token_ids, 0, count)
    return None if tokens is None else tokens.tobytes()


class TensorMapping(Protocol):
    """An engine's memory as mapped for one session."""

    def close(self) -> None:
        """Unmap it (once no tensor built on it is alive); idempotent."""

    def owner_exited(self) -> bool:
        """Whether the engine process that owns the memory is gone."""

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the engine's memory mapped into this process."""

    def lost(self) -> bool:
        """Whether any of the memory was taken away under the sidecar (its file shrunk):
        what was read from it since may be zeros, and what was written, gone."""


class EngineSession:
    """One registered engine: what the pipeline needs to serve its requests."""

    def __init__(
        self,
        engine_id: str,
        identity: bytes,
        layout: KVCacheLayout,
        store_groups: tuple[StoreGroupGeometry, ...],
        *,
        hash_seed: str | None,
        engine_hashes_only: bool = False,
        lookup_only: bool = False,
        mapping: TensorMapping | None = None,
        peer: Peer | None = None,
        tenant: str = "default",
    ) -> None:
        """``identity``: the connection (routing id) it registered on; ``peer``: who
        registered it (the only one who may use it); ``tenant``: whose namespace it is."""
        self.engine_id = engine_id
        self.peer = peer or Peer("")
        self.tenant = tenant
        self.log = structlog.get_logger("kvsidecar.requests").bind(engine_id=engine_id)
        """Logs about this engine's requests, with its id bound."""
        self.identity = identity
        self.layout = layout
        self.store_groups = store_groups
        self.hash_seed = hash_seed
        self.engine_hashes_only = engine_hashes_only
        """The engine hashes with an algorithm the sidecar does not compute: its
        requests must carry their block hashes, which cannot be checked."""
        self.lookup_only = lookup_only
        self.last_seen = time.monotonic()
        self.closed = False
        self.jobs_in_flight = 0
        self.saves_in_flight = 0
        self._mapping = mapping
        self._memory_lost = None if mapping is None else mapping.lost
        self._hashers: collections.OrderedDict[str, _KeptChain] = collections.OrderedDict()
        """Request id -> its hash chain, the most recently kept last."""
        self._kept_bytes = 0
        """Bytes the kept chains hold (``HASHER_CACHE_BYTES`` at most)."""
        self._hashers_lock = threading.Lock()
        self.speller = KeySpeller()
        """Spells this engine's keys, remembering them (the event loop's alone)."""
        self._first_hashes: collections.OrderedDict[tuple[RequestKeys, bytes], bytes] = (
            collections.OrderedDict())
        """``(compact keys, the first block's tokens as uint32 bytes)`` -> its hash, the
        most recently used last (``first_block_hash``)."""

    def close(self) -> None:
        """Stop serving this engine; its mappings go once no job of it is in flight."""
        if not self.closed:
            self.closed = True
            with self._hashers_lock:
                self._hashers.clear()
                self._kept_bytes = 0
            self._release_if_idle()

    def owner_exited(self) -> bool:
        """Whether the engine process whose memory this session maps is gone."""
        return self._mapping is not None and self._mapping.owner_exited()

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the engine's memory this session holds mapped."""
        return 0 if self._mapping is None else self._mapping.mapped_bytes

    def memory_lost(self) -> bool:
        """Whether the engine's memory shrank under the sidecar: nothing read from it
        since may be stored, and nothing written to it counts as loaded. Still heard
        once the session let go of its mapping, while a copy may be in flight."""
        return self._memory_lost is not None and self._memory_lost()

    def job_started(self, *, save: bool) -> None:
        self.jobs_in_flight += 1
        self.saves_in_flight += save

    def job_finished(self, *, save: bool) -> None:
        self.jobs_in_flight -= 1
        self.saves_in_flight -= save
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        # A worker thread may still be copying engine memory: unmap only when idle.
        if self.closed and self.jobs_in_flight == 0:
            mapping, self._mapping = self._mapping, None
            # Drop our views first: a mapping is only unmapped once no tensor uses it.
            self.store_groups = ()
            if mapping is not None:
                mapping.close()

    def fine_hashes(
        self, token_ids: Sequence[int], keys: RequestKeys, request_id: str | None = None
    ) -> list[bytes]:
        """Fine hashes of the request's full blocks, reusing a growing request's prefix."""
        if request_id is None:
            return self.new_hasher(keys).extend(token_ids)
        hasher = self.take_hasher(request_id, keys, token_ids)
        hashes = list(hasher.extend(token_ids))
        self.keep_hasher(request_id, keys, hasher, token_ids)
        return hashes

    def take_hasher(
        self, request_id: str, keys: RequestKeys, token_ids: Sequence[int]
    ) -> RequestHasher:
        """A hasher going on with the request's kept chain if that chain's tokens begin
        ``token_ids`` under the same keys, else a new one. The chain is taken out of the
        cache while used (safe from worker threads: two calls for one request never
        extend the same chain; the second starts afresh)."""
        with self._hashers_lock:
            kept = self._hashers.pop(request_id, None)
            if kept is not None:
                self._kept_bytes -= kept.cost
        hasher = self.new_hasher(keys)
        # Same id, other keys or tokens: never trust the old chain.
        if kept is not None and kept.keys == compact_keys(keys) and _token_bytes(
                token_ids, len(kept.seen) // TOKEN_BYTES) == kept.seen:
            hasher.resume(kept.hashes, kept.mm_next)
        return hasher

    def keep_hasher(
        self, request_id: str, keys: RequestKeys, hasher: RequestHasher,
        token_ids: Sequence[int],
    ) -> None:
        """Cache a hasher for the request's next call (lookup, load or save)."""
        seen = _token_bytes(token_ids, len(hasher.hashes) * self.layout.hash_block_size)
        if seen is None:
            return  # hashed in Python, as CBOR spells a large integer: not kept
        hashes, mm_next = hasher.chain()
        with self._hashers_lock:
            old = self._hashers.pop(request_id, None)
            if old is not None:
                self._kept_bytes -= old.cost
            kept_keys = compact_keys(keys)
            cost = len(seen) + len(hashes) + keys_size(kept_keys)
            self._hashers[request_id] = _KeptChain(kept_keys, hashes, mm_next, seen, cost)
            self._kept_bytes += cost
            while (len(self._hashers) > HASHER_CACHE_SIZE
                   or self._kept_bytes > HASHER_CACHE_BYTES):
                self._kept_bytes -= self._hashers.popitem(last=False)[1].cost

    def new_hasher(self, keys: RequestKeys) -> RequestHasher:
        return RequestHasher(
            self.layout.hash_block_size,
            lora_name=keys.lora_name,
            lora_path=keys.lora_path,
            cache_salt=keys.cache_salt,
            mm_items=keys.mm_items,
            seed=self.hash_seed,
        )

    def first_block_hash(self, keys: RequestKeys, tokens: bytes) -> bytes:
        """The hash of a request's first block (its tokens as uint32 bytes): how every
        request's engine hashes are checked, remembered since prompts tend to open with
        the same block (a system prompt), and an engine asks again for a waiting request
        every step."""
        remembered = self._first_hashes
        key = (compact_keys(keys), tokens)
        found = remembered.get(key)
        if found is not None:
            remembered.move_to_end(key)
            return found
        found = remembered[key] = self._first_block_hash(keys, tokens)
        if len(remembered) > FIRST_HASH_CACHE_SIZE:
            remembered.popitem(last=False)
        return found

    def _first_block_hash(self, keys: RequestKeys, tokens: bytes) -> bytes:
        ids = array.array(TOKEN_TYPECODE)
        ids.frombytes(tokens)
        return self.new_hasher(keys).extend(ids)[0]

    def group_hashes(self, store_group: int, fine: Sequence[bytes]) -> list[bytes]:
        """Block hashes of a store group's blocks 0..n-1 for the given fine hashes."""
        size = self.store_groups[store_group].group.block_size
        return group_block_hashes(fine, self.layout.hash_block_size, size)

    def check_block_ids(self, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        """Project per-kv-group block ids to store groups, checking every id is in range."""
        if len(block_ids) != len(self.layout.groups):
            raise ProtocolError(
                f"expected block ids for {len(self.layout.groups)} kv-cache groups, "
                f"got {len(block_ids)}"
            )
        projected = self.layout.project_block_ids(block_ids)
        for geometry, ids in zip(self.store_groups, projected, strict=True):
            for block_id in ids:
                if block_id != NULL_BLOCK_ID and not 0 < block_id < geometry.num_blocks:
                    raise ProtocolError(
                        f"block id {block_id} of kv-cache group {geometry.kv_group_id} is out of "
                        f"range (the engine registered {geometry.num_blocks} blocks)"
                    )
        return projected
