"""What an engine registers: its layout, the handles of its shared KV tensors, the
self-test of its block hasher, and the step event of a GPU engine."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from pipeline.core.errors import ConfigError
from pipeline.core.hashing import block_hashes
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import CudaIpcEvent, HashSelfTest, Register
from transport.tensors import Segments, tensor_handle

__all__ = ["BlockHasher", "KVCacheShape", "Registration"]

KVCacheShape = Literal["blocks_first", "kv_first"]
BlockHasher = Callable[[Sequence[int], int], list[bytes]]


def _block_dim(tensor: torch.Tensor, shape: KVCacheShape | None) -> int:
    if shape is not None:
        return 0 if shape == "blocks_first" else 1
    # vLLM's K/V-first tensors are [2, num_blocks, ...]; anything else is blocks-first.
    return 1 if tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] != 2 else 0


def _step_event(
    kv_caches: Mapping[str, torch.Tensor], payload: set[str]
) -> tuple[torch.cuda.Event | None, CudaIpcEvent | None]:
    """The step event of an engine whose shared KV is on a GPU (one device)."""
    devices = {tensor.device for layer, tensor in kv_caches.items()
               if layer in payload and tensor.device.type == "cuda"}
    if not devices:
        return None, None
    if len(devices) > 1:
        raise ConfigError(f"an engine's KV tensors are on one GPU, not {sorted(map(str, devices))}")
    from transport.cuda_ipc import step_event

    return step_event(devices.pop().index or 0)


@dataclasses.dataclass(frozen=True)
class Registration:
    message: Register
    segments: Segments
    """The memory files the registration hands over."""
    step: torch.cuda.Event | None
    """A GPU engine's step event, recorded after each forward (``mark_step``)."""

    @classmethod
    def of(
        cls, layout: KVCacheLayout, kv_caches: Mapping[str, torch.Tensor], *,
        engine_id: str | None, kv_cache_shape: KVCacheShape | None, hash_seed: str | None,
        block_hasher: BlockHasher | None, hash_algo: str, lookup_only: bool,
        share_in_place: bool,
    ) -> Registration:
        """The registration of an engine (``EngineClient.connect`` documents the
        arguments): only the tensors of stored groups' layers are shared."""
        payload = {layer for layers in layout.payload_layers for layer in layers}
        segments = Segments()
        handles = tuple(
            tensor_handle(layer, tensor, segments,
                          block_dim=_block_dim(tensor, kv_cache_shape),
                          share_in_place=share_in_place)
            for layer, tensor in kv_caches.items()
            if layer in payload
        )
        step, step_handle = _step_event(kv_caches, payload)
        tokens = tuple(range(1, 2 * layout.hash_block_size + 1))
        hasher = block_hasher or (lambda t, size: block_hashes(t, size, seed=hash_seed))
        self_test = HashSelfTest(tokens, tuple(hasher(tokens, layout.hash_block_size)))
        engine_id = engine_id or f"engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        message = Register(engine_id, layout, handles, self_test, hash_seed,
                           hash_algo=hash_algo, lookup_only=lookup_only,
                           step_event=step_handle)
        return cls(message, segments, step)
