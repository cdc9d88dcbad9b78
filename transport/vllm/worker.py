"""The connector in each vLLM worker: vLLM's KV tensors shared, loads and saves issued.

Registration shares vLLM's own KV cache with the sidecar without copying it through
any socket: on CPU its memory is moved into shared memory in place, before the first
forward (every view vLLM holds follows), and the sidecar maps it by descriptor.

Loads were planned asynchronous by the scheduler side: they are issued after the
step's forward (which never reads those blocks) and reported when done. Saves are
handed over after the forward, never waited for: the scheduler side holds their blocks
out of vLLM's free pool until this worker reports them over (``saves_done``), so no
forward writes a block a save may still read.

A save or load is reported only once the sidecar can no longer touch its blocks (the
client's contract): a request past ``timeout_s`` is cancelled, and reported when the
sidecar answers the cancel or is proven gone, never on a timer alone. Every planned
save and load is reported exactly once, success or not: a sidecar that is down or
restarting costs recomputation, never wrong tokens. One that is stalled but alive keeps
the blocks of its requests until it answers or is restarted (the client logs the wait
every ``HELD_LOG_S``); the rest of the engine goes on.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pipeline.core.errors import LayoutError, TransportError
from pipeline.core.layout import KVCacheLayout
from transport.client import BlockingEngineClient, KVCacheShape, LoadResult
from transport.tensors import Segments, tensor_handle
from transport.vllm.config import ConnectorConfig
from transport.vllm.layout import vllm_block_hasher
from transport.vllm.link import SidecarLink
from transport.vllm.plan import LoadPlan, SavesDone, StepPlan

__all__ = ["WorkerSide"]

log = structlog.get_logger("kvsidecar.vllm")


def kv_cache_shape(tensors: Iterable[torch.Tensor], num_blocks: int) -> KVCacheShape:
    """How vLLM laid its per-layer KV tensors out: blocks first (``[num_blocks, ...]``,
    e.g. LBHNC) or K/V first (``[2, num_blocks, ...]``)."""
    shapes: set[KVCacheShape] = set()
    for tensor in tensors:
        if tensor.shape[0] == num_blocks:
            shapes.add("blocks_first")
        elif tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
            shapes.add("kv_first")
        else:
            raise LayoutError(
                f"a KV tensor of shape {tuple(tensor.shape)} has neither [num_blocks, ...] "
                f"nor [2, num_blocks, ...] with vLLM's {num_blocks} blocks (a kernel block "
                "size other than the cache's is not supported)"
            )
    if len(shapes) != 1:
        raise LayoutError(f"KV tensors mix layouts {sorted(shapes)}")
    return shapes.pop()


class WorkerSide:
    def __init__(
        self, config: ConnectorConfig, layout: KVCacheLayout, *, hash_algo: str,
        num_blocks: int,
    ) -> None:
        self._config = config
        self._layout = layout
        self._hash_algo = hash_algo
        self._num_blocks = num_blocks
        self._single_group = len(layout.groups) == 1
        self._loads: dict[str, tuple[LoadPlan, Future[LoadResult]]] = {}
        self._saving: dict[int, tuple[str, Future[Any]]] = {}
        """Saves in flight: ``save_id`` -> request and call."""
        self._saved: list[int] = []
        """Saves over, not yet reported."""
        self._invalid: set[int] = set()
        self.link: SidecarLink[BlockingEngineClient] | None = None

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        payload = {layer for layers in self._layout.payload_layers for layer in layers}
        tensors = {layer: t for layer, t in kv_caches.items() if layer in payload}
        missing = payload - tensors.keys()
        if missing:
            raise LayoutError(f"vLLM registered no KV tensor for layers {sorted(missing)}")
        shape = kv_cache_shape(tensors.values(), self._num_blocks)
        on_gpu = any(tensor.device.type == "cuda" for tensor in tensors.values())
        if not on_gpu:
            # Move the memory into shared memory now, before any forward runs: views
            # vLLM holds follow the move, and the bytes are kept. GPU memory is shared
            # by CUDA IPC handle as it is.
            segments = Segments()
            for layer, tensor in tensors.items():
                tensor_handle(layer, tensor, segments, share_in_place=True)
        self.link = SidecarLink(self._config, "worker", BlockingEngineClient, lambda: {
            "heartbeat_interval_s": self._config.heartbeat_interval_s,
            "layout": self._layout,
            "kv_caches": tensors,
            "kv_cache_shape": shape,
            "share_in_place": not on_gpu,
            "hash_algo": self._hash_algo,
            "hash_seed": os.environ.get("PYTHONHASHSEED"),
            "block_hasher": vllm_block_hasher(self._hash_algo),
            "engine_id": f"vllm-worker-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        })
        if self.link.wait_connected(self._config.connect_timeout_s) is not None:
            return
        refused = self.link.refused
        if refused is None:
            log.warning("vllm.register.sidecar_not_ready", endpoint=self._config.endpoint)
        elif self._config.on_refused_layout == "fail":
            raise LayoutError(
                f"the sidecar at {self._config.endpoint} refused this engine's KV cache: "
                f"{refused} (kv_connector_extra_config on_refused_layout: continue runs "
                "the engine without it)"
            ) from refused
    # -- per step ---------------------------------------------------------------------

    def start_load_kv(self, plan: StepPlan) -> None:
        client = self.link.client() if self.link is not None else None
        for load in plan.loads:
            if client is None:
                future: Future[LoadResult] = Future()
                future.set_exception(ConnectionError("the sidecar is not connected"))
            else:
                future = client.start_load(
                    load.request_id, load.token_ids, load.block_ids, load.num_tokens,
                    block_hashes=load.block_hashes, computed_tokens=load.computed_tokens,
                    timeout_s=self._config.timeout_s, **load.keys,
                )
            self._loads[load.request_id] = (load, future)

    def wait_for_save(self, plan: StepPlan) -> None:
        """Hand the step's saves over; the forward never waits for them."""
        client = self.link.client() if self.link is not None else None
        for index, save in enumerate(plan.saves):
            if client is None:
                self._saved.append(save.save_id)  # a cache fill skipped
                continue
            try:
                future = client.start_save(
                    save.request_id, save.token_ids, save.block_ids,
                    block_hashes=save.block_hashes, timeout_s=self._config.timeout_s,
                    **save.keys,
                )
            except BaseException:
                # This save and the step's later ones were never sent: nothing reads
                # their blocks.
                self._saved.extend(later.save_id for later in plan.saves[index:])
                raise
            self._saving[save.save_id] = (save.request_id, future)

    def saves_done(self) -> SavesDone | None:
        """The saves over since the last call, each reported once (the scheduler side
        then hands their blocks back to vLLM)."""
        for save_id, (req_id, future) in list(self._saving.items()):
            if future.done():
                del self._saving[save_id]
                self._saved.append(save_id)
                error = future.exception()
                if error is not None:
                    log.info("vllm.save.failed", request_id=req_id, error=str(error))
        if not self._saved:
            return None
        done, self._saved = SavesDone(dict.fromkeys(self._saved, 1)), []
        return done

    def transfer_results(self) -> KVConnectorTransferResults:
        """Loads over since the last call. A finished request's blocks wait only for
        its load (the scheduler side delays its free for nothing else): no request is
        ever reported ``finished_sending``."""
        results = KVConnectorTransferResults()
        for req_id, (load, future) in list(self._loads.items()):
            if future.done():
                del self._loads[req_id]
                results.finished_recving.add(req_id)
                if not self._loaded(load, future):
                    results.failed_recving.add(req_id)
        return results

    def _loaded(self, load: LoadPlan, future: Future[LoadResult]) -> bool:
        """Whether the load gave everything it planned; a failed one is recomputed."""
        error = future.exception()
        if error is not None:
            if self.link is not None and isinstance(error, TransportError):
                self.link.failed(error)
            log.warning("vllm.load.failed", request_id=load.request_id, error=str(error))
            invalid = self._planned_block_ids(load)
        else:
            result = future.result()
            if result.loaded_tokens >= load.num_tokens:
                return True
            log.warning("vllm.load.partial", request_id=load.request_id,
                        loaded_tokens=result.loaded_tokens, num_tokens=load.num_tokens)
            invalid = set(result.invalid_block_ids) or self._planned_block_ids(load)
        if self._single_group:
            # vLLM keeps what loaded and recomputes from the first failed block.
            self._invalid |= invalid
            return True
        return False

    def _planned_block_ids(self, load: LoadPlan) -> set[int]:
        size = self._layout.groups[0].block_size
        ids = load.block_ids[0][load.computed_tokens // size : load.num_tokens // size]
        return {block for block in ids if block}

    def block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        """Let saves in flight finish (bounded), then unregister."""
        pending = [future for _, future in self._saving.values()]
        pending.extend(future for _, future in self._loads.values())
        if pending:
            wait_futures(pending, timeout=self._config.timeout_s)
        if self.link is not None:
            self.link.close()

