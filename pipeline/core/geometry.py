"""Store-group geometry: engine-facing KV tensors made store-ready.

For each store group, the byte segments that make up one stored value, in the fixed
registered order (layers in layout order, K before V), each segment seen as a
``[num_blocks, page_bytes]`` matrix of engine memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from pipeline.core.errors import LayoutError
from pipeline.core.integrity import CHECKSUM_BYTES, fingerprint_seed
from pipeline.core.keys import layout_key_prefixes
from pipeline.core.layout import KVCacheGroup, KVCacheLayout

__all__ = ["Segment", "StoreGroupGeometry", "build_lookup_groups", "build_store_groups"]


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


def build_lookup_groups(layout: KVCacheLayout) -> tuple[StoreGroupGeometry, ...]:
    """Store groups of a session that only looks up: their keys and hit rule, no memory."""
    prefixes = layout_key_prefixes(layout)
    return tuple(
        StoreGroupGeometry(kv_group_id, layout.groups[kv_group_id], (), 0, 0, prefixes[index])
        for index, kv_group_id in enumerate(layout.prefix_cacheable_group_ids)
    )
