"""The connector in each vLLM worker: vLLM's KV tensors shared, loads and saves issued.

Registration shares vLLM's own KV cache with the sidecar without copying it through
any socket: on CPU its memory is moved into shared memory in place, before the first
forward (every view vLLM holds follows), and the sidecar maps it by descriptor.

Loads were planned asynchronous by the scheduler side: they are issued after the
step's forward (which never reads those blocks) and reported when done. Saves are
handed over after the forward and reported once the sidecar has them. Blocks vLLM may
reuse while their save runs are handled so that the forward rarely waits: those of a
sliding window, chunked local attention or Mamba state are saved from a snapshot taken
right after the forward (``transport.vllm.snapshot``, KV on CPU); a save still reading
such blocks in place (KV on GPU, no snapshot free to take) or a preempted request's
blocks (vLLM freed them) is waited for before the next forward, in
``handle_preemptions``.

A save or load is reported only once the sidecar can no longer touch its blocks (the
client's contract): a request past ``timeout_s`` is cancelled, and reported when the
sidecar answers the cancel or is proven gone, never on a timer alone. Every planned
save and load is reported exactly once, success or not: a sidecar that is down or
restarting costs recomputation, never wrong tokens. One that is stalled but alive holds
the blocks of its requests (and a forward that must not overwrite them) until it
answers or is restarted; the wait is logged every ``HELD_LOG_S``.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import structlog
import torch

from pipeline.core.errors import LayoutError, TransportError
from pipeline.core.layout import KVCacheLayout
from transport.client import HELD_LOG_S, BlockingEngineClient, KVCacheShape, LoadResult
from transport.tensors import Segments, tensor_handle
from transport.vllm.config import ConnectorConfig
from transport.vllm.layout import vllm_block_hasher
from transport.vllm.link import SidecarLink
from transport.vllm.plan import LoadPlan, SavePlan, StepPlan
from transport.vllm.scheduler import FENCED_KINDS
from transport.vllm.snapshot import Snapshots

__all__ = ["TransferResults", "WorkerSide"]

log = structlog.get_logger("kvsidecar.vllm")


@dataclasses.dataclass(slots=True)
class TransferResults:
    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(slots=True)
class _Save:
    future: Future[Any]
    fence: bool


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
        self._saves: dict[str, list[_Save]] = {}
        """Requests with planned saves since they last started: their blocks are freed
        only once all of them are done and the request has finished."""
        self._finished: set[str] = set()
        self._invalid: set[int] = set()
        self.link: SidecarLink[BlockingEngineClient] | None = None
        self._snapshots: Snapshots | None = None
        self._snapshot_link: SidecarLink[BlockingEngineClient] | None = None
        self._snapshot_from: tuple[Mapping[str, torch.Tensor], KVCacheShape,
                                   list[bool]] | None = None
        """What snapshot memory is made from, until it is made."""

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
        fenced = [group.kind in FENCED_KINDS for group in self._layout.groups]
        if not on_gpu and any(fenced) and self._config.snapshot_blocks:
            self._snapshot_from = (tensors, shape, fenced)
        if self.link.wait_connected(self._config.connect_timeout_s) is None:
            log.warning("vllm.register.sidecar_not_ready", endpoint=self._config.endpoint)
        elif self._snapshots_wanted():
            self._open_snapshots()
            assert self._snapshot_link is not None
            self._snapshot_link.wait_connected(self._config.connect_timeout_s)

    def _snapshots_wanted(self) -> bool:
        """Whether snapshot memory is to be made now: it could be (fenced groups, KV on
        CPU, ``snapshot_blocks``), is not yet, and the sidecar stores native values (a
        vllm-format value spans every stored layer of a block id: a save cannot be taken
        apart by group, and a registration of other tensors would change the value
        size lookups expect)."""
        if self._snapshot_from is None:
            return False
        client = self.link.client() if self.link is not None else None
        registered = client.registered if client is not None else None
        if registered is None:
            return False
        if registered.value_format != "native":
            self._snapshot_from = None
            log.info("vllm.save.snapshots_off", reason="the sidecar stores vllm-format "
                     "values, which span every layer: fenced saves read in place")
            return False
        return True

    def _open_snapshots(self) -> None:
        """Snapshot memory for the fenced groups' saves, registered as an engine of its
        own (``transport.vllm.snapshot``); its link connects in the background."""
        assert self._snapshot_from is not None
        tensors, shape, fenced = self._snapshot_from
        self._snapshot_from = None
        snapshots = Snapshots(self._layout, tensors, 0 if shape == "blocks_first" else 1,
                              self._config.snapshot_blocks, fenced)
        self._snapshots = snapshots
        self._snapshot_link = SidecarLink(
            self._config, "worker-snapshot", BlockingEngineClient, lambda: {
                "heartbeat_interval_s": self._config.heartbeat_interval_s,
                "layout": self._layout,
                "kv_caches": snapshots.tensors,
                "kv_cache_shape": shape,
                "hash_algo": self._hash_algo,
                "hash_seed": os.environ.get("PYTHONHASHSEED"),
                "block_hasher": vllm_block_hasher(self._hash_algo),
                "engine_id": f"vllm-snapshot-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            })

    # -- per step ---------------------------------------------------------------------

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Before the forward: wait for saves whose blocks it may overwrite."""
        waiting = [s.future for saves in self._saves.values() for s in saves if s.fence]
        for req_id in plan.preempted:
            waiting.extend(s.future for s in self._saves.pop(req_id, ()))
        if waiting:
            # Until each is done: a save's future ends only once the sidecar can no
            # longer read its blocks (answered, cancelled, or proven gone).
            started = time.monotonic()
            while wait_futures(waiting, timeout=HELD_LOG_S).not_done:
                log.warning("vllm.forward.held", saves=len(waiting),
                            held_s=round(time.monotonic() - started, 1),
                            reason="saves of blocks this forward may overwrite are not "
                                   "yet answered by the sidecar")
            for saves in self._saves.values():
                for save in saves:
                    save.fence = False

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
        """Hand the step's saves over; the forward never waits for them here."""
        client = self.link.client() if self.link is not None else None
        for save in plan.saves:
            saves = self._saves.setdefault(save.request_id, [])
            if client is None:
                continue  # a cache fill skipped; the request still reports finished
            block_ids, fence = save.block_ids, save.fence
            if fence:
                block_ids, fence = self._save_snapshot(save, saves)
            if not any(any(ids) for ids in block_ids):
                continue
            future = client.start_save(
                save.request_id, save.token_ids, block_ids,
                block_hashes=save.block_hashes, timeout_s=self._config.timeout_s,
                **save.keys,
            )
            saves.append(_Save(future, fence))

    def _save_snapshot(self, save: SavePlan, saves: list[_Save]
                       ) -> tuple[tuple[list[int], ...], bool]:
        """Save a fenced save's fenced blocks from a snapshot taken now: the blocks left
        to save in place, and whether the next forward must still wait for them (no
        snapshot to take: GPU memory, none configured, or its link down)."""
        if self._snapshots_wanted():  # the sidecar was not up at registration
            self._open_snapshots()
        snapshots, link = self._snapshots, self._snapshot_link
        client = link.client() if link is not None else None
        if snapshots is None or client is None:
            return save.block_ids, True
        stable, snapshot, slots = snapshots.take(save.block_ids)
        if snapshot is None:
            log.info("vllm.save.snapshot_full", request_id=save.request_id,
                     skipped=snapshots.skipped)
            return stable, False
        try:
            future = client.start_save(
                save.request_id, save.token_ids, snapshot, block_hashes=save.block_hashes,
                timeout_s=self._config.timeout_s, **save.keys)
        except BaseException:
            snapshots.release(slots)
            raise
        future.add_done_callback(lambda _: snapshots.release(slots))
        saves.append(_Save(future, False))
        return stable, False

    def transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        results = TransferResults()
        self._finished |= finished_req_ids
        for req_id, (load, future) in list(self._loads.items()):
            if future.done():
                del self._loads[req_id]
                results.finished_recving.add(req_id)
                if not self._loaded(load, future):
                    results.failed_recving.add(req_id)
        for req_id in list(self._finished):
            if req_id in self._loads:
                continue  # the load's report frees the blocks
            saves = self._saves.get(req_id)
            if saves is None or req_id in results.finished_recving:
                self._saves.pop(req_id, None)
                self._finished.discard(req_id)
            elif all(save.future.done() for save in saves):
                self._report_saves(req_id, saves)
                del self._saves[req_id]
                self._finished.discard(req_id)
                results.finished_sending.add(req_id)
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

    def _report_saves(self, req_id: str, saves: list[_Save]) -> None:
        for save in saves:
            error = save.future.exception()
            if error is not None:
                log.info("vllm.save.failed", request_id=req_id, error=str(error))

    def block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        """Let saves in flight finish (bounded), then unregister."""
        pending = [s.future for saves in self._saves.values() for s in saves]
        pending.extend(future for _, future in self._loads.values())
        if pending:
            wait_futures(pending, timeout=self._config.timeout_s)
        if self.link is not None:
            self.link.close()
        if self._snapshot_link is not None:
            self._snapshot_link.close()

