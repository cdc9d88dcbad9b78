"""Snapshots of the blocks vLLM may reuse while their save runs.

vLLM frees or rewrites some of a running request's blocks as it goes on: a sliding
window or a chunk of local attention moves past them, and Mamba state in align mode is
written again at the next step. A save of such blocks, left to read them in place,
would make the next forward wait for the sidecar. Instead the worker copies them, right
after the forward that wrote them, into snapshot memory the connector owns, and saves
them from there: that memory is registered with the sidecar as an engine of its own
(the same layout, so the same keys), and a forward never waits on the sidecar for them.
A slot is free again once its save's call is over (the client's contract: the sidecar
no longer reads it). With too few slots free, a save's fenced blocks are not saved (a
cache fill skipped), never waited for.

Snapshot memory holds ``1 + slots`` blocks of every stored layer (block 0 stands for
vLLM's null block, never used): the registration names every stored layer, with one
block count (as the sidecar's vLLM value format requires), though only fenced layers
are ever saved from it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from pipeline.core.layout import KVCacheLayout
from transport.tensors import shared_kv_tensor

__all__ = ["Snapshots"]


class Snapshots:
    def __init__(self, layout: KVCacheLayout, tensors: Mapping[str, torch.Tensor],
                 block_dim: int, slots: int, fenced: Sequence[bool]) -> None:
        """``tensors``: vLLM's KV tensors of the stored layers, blocks along
        ``block_dim``; ``fenced[g]``: whether kv-cache group ``g``'s blocks are
        snapshotted."""
        self._layout = layout
        self._fenced = list(fenced)
        self._sources = dict(tensors)
        self._block_dim = block_dim
        self.tensors: dict[str, torch.Tensor] = {}
        """The snapshot memory, a tensor per stored layer (register these)."""
        for layer, source in self._sources.items():
            shape = list(source.shape)
            shape[block_dim] = 1 + slots
            self.tensors[layer] = shared_kv_tensor(shape, source.dtype)
        self._free = list(range(slots, 0, -1))
        self._lock = threading.Lock()
        self.skipped = 0
        """Saves whose fenced blocks found too few slots free, and were not saved."""

    def fenced(self, block_ids: Sequence[Sequence[int]]) -> bool:
        return any(self._fenced[group] and any(ids) for group, ids in enumerate(block_ids))

    def take(self, block_ids: Sequence[Sequence[int]]
             ) -> tuple[tuple[list[int], ...], tuple[list[int], ...] | None, list[int]]:
        """Split a save's blocks (one list per kv-cache group, 0: leave it): the blocks
        of groups that are not fenced, as they are; the fenced groups' blocks copied
        into snapshot slots, as the snapshot's block ids (None: too few slots free, not
        saved); and the slots taken, to ``release`` once that save is over."""
        stable = tuple([] if self._fenced[group] else list(ids)
                       for group, ids in enumerate(block_ids))
        wanted = sum(1 for group, ids in enumerate(block_ids) if self._fenced[group]
                     for block in ids if block)
        with self._lock:
            if wanted > len(self._free):
                self.skipped += 1
                return stable, None, []
            slots = [self._free.pop() for _ in range(wanted)]
        taken = iter(slots)
        snapshot = tuple(
            [next(taken) if block else 0 for block in ids] if self._fenced[group] else []
            for group, ids in enumerate(block_ids))
        for group, (ids, into) in enumerate(zip(block_ids, snapshot, strict=True)):
            if self._fenced[group] and any(ids):
                self._copy(group, [b for b in ids if b], [s for s in into if s])
        return stable, snapshot, slots

    def release(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def _copy(self, group: int, blocks: list[int], slots: list[int]) -> None:
        """vLLM's ``blocks`` of a fenced group, layer by layer, into ``slots``."""
        source_ids = torch.tensor(blocks, dtype=torch.long)
        slot_ids = torch.tensor(slots, dtype=torch.long)
        dim = self._block_dim
        for layer in self._layout.groups[group].layers:
            source = self._sources[layer]
            self.tensors[layer].index_copy_(dim, slot_ids,
                                            source.index_select(dim, source_ids))
