"""Engine sessions: a registered engine's layout, mapped KV tensors and hashing state.

Everything here is engine-facing geometry made store-ready: for each store group the
byte segments that make up one stored value, in the fixed registered order (layers in
layout order, K before V), each segment seen as a ``[num_blocks, page_bytes]`` matrix.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from pipeline.errors import LayoutError, ProtocolError
from pipeline.hashing import RequestHasher, group_block_hashes
from pipeline.integrity import CHECKSUM_BYTES, fingerprint_seed
from pipeline.keys import keys_for, layout_key_prefixes
from pipeline.layout import NULL_BLOCK_ID, KVCacheGroup, KVCacheLayout
from pipeline.messages import RequestKeys

__all__ = ["EngineSession", "Segment", "StoreGroupGeometry", "build_store_groups"]

HASHER_CACHE_SIZE = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    blocks: torch.Tensor
    """A ``[num_blocks, page_bytes]`` uint8 view of engine memory (no copy)."""
    offset: int
    """Where this segment's page starts inside one stored value."""

    @property
    def page_bytes(self) -> int:
        return int(self.blocks.shape[1])


@dataclasses.dataclass(frozen=True, slots=True)
class StoreGroupGeometry:
    kv_group_id: int
    group: KVCacheGroup
    segments: tuple[Segment, ...]
    value_bytes: int
    """Payload bytes of one block: every segment's page, in order."""
    num_blocks: int
    key_prefix: str
    checksum_seed: int | None = None
    """Seed of the checksum sealed after the payload; None: values carry no checksum."""

    @property
    def stored_bytes(self) -> int:
        """Bytes of one stored value: the payload plus its checksum, if any."""
        return self.value_bytes + (0 if self.checksum_seed is None else CHECKSUM_BYTES)


def _block_pages(layer: str, tensor: torch.Tensor, block_dim: int) -> list[torch.Tensor]:
    """A layer tensor as blocks-first pieces: one for ``[N, ...]``, K and V for ``[2, N, ...]``."""
    if block_dim == 0:
        pieces = [tensor]
    else:
        if tensor.dim() < 2 or tensor.shape[0] != 2:
            raise LayoutError(
                f"layer {layer!r}: K/V-first tensors must have shape [2, num_blocks, ...]"
            )
        pieces = [tensor[0], tensor[1]]
    pages = []
    for piece in pieces:
        if piece.dim() < 1 or piece.shape[0] == 0:
            raise LayoutError(f"layer {layer!r}: tensor has no blocks")
        flat = piece.reshape(piece.shape[0], -1) if piece[0].is_contiguous() else None
        if flat is None or flat.stride(1) != 1:
            raise LayoutError(f"layer {layer!r}: each block's page must be contiguous")
        pages.append(flat.view(torch.uint8))
    return pages


def build_store_groups(
    layout: KVCacheLayout,
    tensors: Mapping[str, tuple[torch.Tensor, int]],
    *,
    checksum: bool = True,
) -> tuple[StoreGroupGeometry, ...]:
    """Store-group geometry from the mapped tensors of the payload layers.

    Layers whose pages alias the same memory within a group are counted once. With
    ``checksum`` every stored value is sealed with a checksum seeded by the fingerprint.
    """
    seed = fingerprint_seed(layout.fingerprint) if checksum else None
    prefixes = layout_key_prefixes(layout)
    result = []
    for index, kv_group_id in enumerate(layout.prefix_cacheable_group_ids):
        group = layout.groups[kv_group_id]
        if not group.layers:
            raise LayoutError(f"group {kv_group_id}: a stored group must name its layers")
        segments: list[Segment] = []
        seen: set[tuple[int, int, int]] = set()
        offset = 0
        num_blocks: int | None = None
        for layer in group.layers:
            if layer not in tensors:
                raise LayoutError(f"group {kv_group_id}: no tensor registered for layer {layer!r}")
            tensor, block_dim = tensors[layer]
            pages = _block_pages(layer, tensor, block_dim)
            layer_bytes = sum(int(p.shape[1]) for p in pages)
            if group.page_bytes and layer_bytes != group.page_bytes:
                raise LayoutError(
                    f"group {kv_group_id}: layer {layer!r} has {layer_bytes} bytes per block, "
                    f"the layout says {group.page_bytes}"
                )
            for page in pages:
                identity = (page.data_ptr(), page.stride(0), int(page.shape[1]))
                if identity in seen:
                    continue
                seen.add(identity)
                blocks = int(page.shape[0])
                num_blocks = blocks if num_blocks is None else min(num_blocks, blocks)
                segments.append(Segment(page, offset))
                offset += int(page.shape[1])
        assert num_blocks is not None
        result.append(
            StoreGroupGeometry(
                kv_group_id, group, tuple(segments), offset, num_blocks, prefixes[index], seed
            )
        )
    return tuple(result)


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
        release: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine_id = engine_id
        self.identity = identity
        self.layout = layout
        self.store_groups = store_groups
        self.hash_seed = hash_seed
        self.last_seen = time.monotonic()
        self.closed = False
        self.jobs_in_flight = 0
        self.saves_in_flight = 0
        self._release = release
        self._hashers: collections.OrderedDict[
            tuple[str, RequestKeys], tuple[RequestHasher, Sequence[int]]
        ] = collections.OrderedDict()
        self._hashers_lock = threading.Lock()

    def close(self) -> None:
        """Stop serving this engine; its mappings go once no job of it is in flight."""
        if not self.closed:
            self.closed = True
            with self._hashers_lock:
                self._hashers.clear()
            self._release_if_idle()

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
            release, self._release = self._release, lambda: None
            # Drop our views first: a mapping is only unmapped once no tensor uses it.
            self.store_groups = ()
            release()

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
        """The request's cached hasher if its chain is a prefix of ``token_ids``, else a
        new one. It is taken out of the cache while used (safe from worker threads: two
        calls for one request never extend the same chain; the second starts afresh)."""
        with self._hashers_lock:
            cached = self._hashers.pop((request_id, keys), None)
        if cached is not None:
            hasher, seen = cached
            if token_ids[: len(seen)] == seen:
                return hasher
            # Same id, other tokens: never trust the old chain.
        return self.new_hasher(keys)

    def keep_hasher(
        self, request_id: str, keys: RequestKeys, hasher: RequestHasher,
        token_ids: Sequence[int],
    ) -> None:
        """Cache a hasher for the request's next call (lookup, load or save)."""
        hashed = len(hasher.hashes) * self.layout.hash_block_size
        with self._hashers_lock:
            self._hashers[(request_id, keys)] = (hasher, token_ids[:hashed])
            while len(self._hashers) > HASHER_CACHE_SIZE:
                self._hashers.popitem(last=False)

    def new_hasher(self, keys: RequestKeys) -> RequestHasher:
        return RequestHasher(
            self.layout.hash_block_size,
            lora_name=keys.lora_name,
            lora_path=keys.lora_path,
            cache_salt=keys.cache_salt,
            mm_items=keys.mm_items,
            seed=self.hash_seed,
        )

    def group_keys(self, store_group: int, fine: Sequence[bytes]) -> list[str]:
        """Store keys of a store group's blocks 0..n-1 for the given fine hashes."""
        geometry = self.store_groups[store_group]
        coarse = group_block_hashes(fine, self.layout.hash_block_size, geometry.group.block_size)
        return keys_for(geometry.key_prefix, coarse)

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
