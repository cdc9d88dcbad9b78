"""Store-group geometry: engine-facing KV tensors made store-ready.

For each store group, the byte segments that make up one stored value, each seen as a
``[num_blocks, page_bytes]`` matrix of engine memory. Their order is the value format's:

- ``native``: the group's own layers in layout order, K before V, then the checksum.
- ``vllm``: exactly vLLM 0.33's ``RankLocalStoreLayout``: every region of *all* stored
  layers, in registration order, for every group (vLLM's groups overlay one buffer).
  A layer's region is its whole storage when its blocks tile it, each head's blocks
  when heads are outermost, else its blocks from the first, each ``stride(0)`` bytes
  long (padding included). Regions at one address are counted once. The checksum is
  not part of the value: the store keeps it beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy
import torch

from pipeline.core.errors import LayoutError
from pipeline.core.integrity import CHECKSUM_BYTES, VLLM_FORMAT_SEED, fingerprint_seed
from pipeline.core.keys import GroupKeys, ValueFormat, layout_keys
from pipeline.core.layout import KVCacheGroup, KVCacheLayout
from pipeline.core.store import ValueScope

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
    keys: GroupKeys
    checksum_seed: int | None = None
    """Seed of the checksum sealed after the payload; None: values carry no checksum."""
    scope: ValueScope | None = None
    """Whose its values are and the layout that reads them (the tenant, the layout's
    fingerprint): kept with each value by a store that outlives the sidecar."""
    step_event: torch.cuda.Event | None = None
    """GPU blocks only: the event the engine records after each forward; a copy out of
    its blocks waits on it."""
    segment_table: numpy.ndarray = dataclasses.field(init=False, repr=False, compare=False)
    """The segments as four int64 rows, one column each: the address of block 0's page,
    the stride between pages, where a page lies in a value, and its bytes: for copies
    that address pages themselves (``pipeline.backends.cpu_copy``)."""
    page_sizes: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    """Each segment's page bytes, in order."""

    def __post_init__(self) -> None:
        table = numpy.array(
            [[s.blocks.data_ptr(), s.blocks.stride(0), s.offset, s.page_bytes]
             for s in self.segments], dtype=numpy.int64,
        ).reshape(-1, 4)
        object.__setattr__(self, "segment_table", numpy.ascontiguousarray(table.T))
        object.__setattr__(self, "page_sizes", tuple(s.page_bytes for s in self.segments))

    @property
    def key_prefix(self) -> str:
        return self.keys.own

    @property
    def stored_bytes(self) -> int:
        """Bytes of one value in flight (a staging row, an embedded-store extent): the
        payload plus its checksum, if any. A vllm-format store holds the checksum beside
        the payload instead (``pipeline.backends.stores.beside``)."""
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
    value_format: ValueFormat = ValueFormat.NATIVE,
    tenant: str = "",
) -> tuple[StoreGroupGeometry, ...]:
    """Store-group geometry from the mapped tensors of the payload layers (in the order
    the engine registered them).

    With ``checksum`` every value is sealed with a checksum: seeded by the fingerprint
    in the native format, by a constant in vLLM's (its keys already name the engine).
    Each group's ``scope`` names ``tenant`` and the fingerprint of what its keys name:
    the layout in the native format, the geometry alone in vLLM's (whose keys are shared
    by ranks holding the same KV).
    """
    keys = layout_keys(layout, value_format)
    if value_format is ValueFormat.VLLM:
        regions, num_blocks = _vllm_regions(layout, tensors)
        value_bytes = sum(segment.page_bytes for segment in regions)
        seed = VLLM_FORMAT_SEED if checksum else None
        shared = ValueScope(tenant, layout.geometry_fingerprint)
        return tuple(
            StoreGroupGeometry(kv_group_id, layout.groups[kv_group_id], regions,
                               value_bytes, num_blocks, keys[index], seed, shared)
            for index, kv_group_id in enumerate(layout.prefix_cacheable_group_ids)
        )
    seed = fingerprint_seed(layout.fingerprint) if checksum else None
    scope = ValueScope(tenant, layout.fingerprint)
    result = []
    for index, kv_group_id in enumerate(layout.prefix_cacheable_group_ids):
        group = layout.groups[kv_group_id]
        _check_named(kv_group_id, group, tensors)
        segments: list[Segment] = []
        seen: set[tuple[int, int, int]] = set()
        offset = 0
        blocks: int | None = None
        for layer in group.layers:
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
                blocks = int(page.shape[0]) if blocks is None else min(blocks, int(page.shape[0]))
                segments.append(Segment(page, offset))
                offset += int(page.shape[1])
        assert blocks is not None
        result.append(StoreGroupGeometry(
            kv_group_id, group, tuple(segments), offset, blocks, keys[index], seed, scope
        ))
    return tuple(result)


def _check_named(
    kv_group_id: int, group: KVCacheGroup, tensors: Mapping[str, tuple[torch.Tensor, int]]
) -> None:
    if not group.layers:
        raise LayoutError(f"group {kv_group_id}: a stored group must name its layers")
    for layer in group.layers:
        if layer not in tensors:
            raise LayoutError(f"group {kv_group_id}: no tensor registered for layer {layer!r}")


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the elements cover one gapless range, in any dimension order."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True),
                               key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _vllm_regions(
    layout: KVCacheLayout, tensors: Mapping[str, tuple[torch.Tensor, int]]
) -> tuple[tuple[Segment, ...], int]:
    """vLLM's ``RankLocalStoreLayout`` regions of all stored layers, and the block count."""
    for kv_group_id in layout.prefix_cacheable_group_ids:
        _check_named(kv_group_id, layout.groups[kv_group_id], tensors)
    stored = {layer for layers in layout.payload_layers for layer in layers}
    regions: dict[int, tuple[torch.Tensor, int, int]] = {}  # address -> (storage, start, len)
    num_blocks: int | None = None
    for layer, (tensor, block_dim) in tensors.items():
        if layer not in stored:
            continue
        if block_dim != 0 or tensor.dim() < 2:
            raise LayoutError(
                f"layer {layer!r}: the vllm value format needs blocks-first tensors "
                "[num_blocks, ...], as vLLM registers them"
            )
        blocks = int(tensor.shape[0])
        if num_blocks not in (None, blocks):
            raise LayoutError(
                f"layer {layer!r} has {blocks} blocks, other layers {num_blocks}: the vllm "
                "value format needs one block count (views of kernel blocks grouped per block)"
            )
        num_blocks = blocks
        storage = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        base, itemsize = storage.data_ptr(), tensor.element_size()
        block_len = tensor.stride(0) * itemsize
        if not _dense(tensor[0]):
            for head in range(tensor.shape[1]):
                head_blocks = tensor[:, head]
                if not _dense(head_blocks[0]):
                    raise LayoutError(f"layer {layer!r}: head {head}'s blocks are not dense")
                regions.setdefault(head_blocks.data_ptr(), (storage, head_blocks.data_ptr() - base,
                                                            block_len))
        elif block_len * blocks == storage.numel():
            regions.setdefault(base, (storage, 0, storage.numel() // blocks))
        else:
            regions.setdefault(tensor.data_ptr(), (storage, tensor.data_ptr() - base, block_len))
    assert num_blocks is not None
    segments: list[Segment] = []
    offset = 0
    for storage, start, length in regions.values():
        if length <= 0 or start + num_blocks * length > storage.numel():
            raise LayoutError(
                f"a region of {num_blocks} blocks of {length} bytes at byte {start} does not "
                f"fit its {storage.numel()}-byte tensor storage"
            )
        view = storage.as_strided((num_blocks, length), (length, 1), start)
        segments.append(Segment(view, offset))
        offset += length
    return tuple(segments), num_blocks


def build_lookup_groups(
    layout: KVCacheLayout, value_format: ValueFormat = ValueFormat.NATIVE
) -> tuple[StoreGroupGeometry, ...]:
    """Store groups of a session that only looks up: their keys and hit rule, no memory."""
    keys = layout_keys(layout, value_format)
    return tuple(
        StoreGroupGeometry(kv_group_id, layout.groups[kv_group_id], (), 0, 0, keys[index])
        for index, kv_group_id in enumerate(layout.prefix_cacheable_group_ids)
    )
