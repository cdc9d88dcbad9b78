"""The backend choices, made once: the store (behind its decorators), the batch memory
and the copy engines every data stage is built with."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import torch

from pipeline.backends.cpu_copy import (
    INLINE_BYTES,
    LOAD_INLINE_BYTES,
    LOAD_STREAM_BYTES,
    CpuCopyEngine,
)
from pipeline.backends.faults import Faults, FaultyStore
from pipeline.backends.in_place_copy import HelperThreads, InPlaceCopyEngine
from pipeline.backends.memory import InPlaceMemory, LentMemory, StagingMemory
from pipeline.backends.staging import StagingPool
from pipeline.backends.stores.beside import ChecksumBesideStore
from pipeline.backends.stores.breaker import CircuitBreakerStore
from pipeline.backends.stores.disk.behind import Moved
from pipeline.backends.stores.disk.tier import DiskTier
from pipeline.backends.threads import WorkerThreads
from pipeline.core.config import Config, StoreConfig, TransferStageConfig
from pipeline.core.errors import ConfigError
from pipeline.core.seams import BatchMemory, CopyEngine
from pipeline.core.store import KVStore, PiecewiseKVStore

__all__ = ["Backends", "open_backends", "open_store"]


Pin = Callable[[torch.Tensor], contextlib.AbstractContextManager[None]]
"""Page-locks host memory for device copies while entered."""
Evicted = Callable[[Sequence[str]], None]
"""Hears the keys a store evicted."""
Usage = Callable[[], tuple[int, int, int]]
"""A store's bytes used, its capacity in bytes, and its evictions so far."""
ReadsHere = Callable[[], tuple[int, int]]
"""Values loads read where they lie in the store's memory so far: loaded, and failed as
read past their lease (``MooncakeStore.reads_here``)."""


@dataclasses.dataclass(frozen=True)
class OpenStore:
    store: CircuitBreakerStore
    usage: Usage | None
    """None: the backend does not say (Mooncake's master keeps the books)."""
    answers_at_once: bool
    """Its queries wait on nothing (in-process, no fault points): a lookup may be
    answered in the receiving task."""
    reads_here: ReadsHere | None = None
    """None: loads never read values where they lie (not Mooncake)."""
    disk: DiskTier | None = None
    """The disk tier under the embedded store, if one is configured."""
    where: Callable[[str], str] | None = None
    """Where the store keeps a key's value (``EmbeddedStore.where``); None: not said."""


@contextlib.asynccontextmanager
async def open_store(
    config: StoreConfig, faults: Faults | None, on_evicted: Evicted, pin: Pin | None = None,
    on_moved: Moved | None = None,
) -> AsyncIterator[OpenStore]:
    """The configured store backend behind a circuit breaker (and fault points, if any),
    closed on exit. ``on_evicted`` hears of the embedded store's evictions, ``on_moved``
    of its values arriving in and leaving memory and disk (``EmbeddedStore``); ``pin``
    pins its memory, which GPU blocks are copied into and out of."""
    async with contextlib.AsyncExitStack() as held:
        store: KVStore
        usage: Usage | None = None
        reads_here: ReadsHere | None = None
        disk: DiskTier | None = None
        where: Callable[[str], str] | None = None
        call_timeout_s: float | None = config.breaker.call_timeout_s
        if config.backend == "mooncake":
            from pipeline.backends.stores.mooncake.setup import open_mooncake_store

            store = mooncake = await open_mooncake_store(config.mooncake)
            reads_here = mooncake.reads_here
        else:
            from pipeline.backends.stores.embedded import EmbeddedStore

            if config.disk.path:
                from pipeline.backends.stores.disk import open_disk_tier

                disk = await held.enter_async_context(open_disk_tier(
                    config.disk, fault=faults.fires if faults is not None else None))
            embedded = EmbeddedStore(
                config.embedded, on_evicted=on_evicted, disk=disk,
                promote=config.disk.promote == "on_hit",
                on_moved=on_moved or (lambda keys, medium, present: None))
            if pin is not None:
                held.enter_context(pin(embedded.memory))
            store = embedded
            where = embedded.where

            def usage() -> tuple[int, int, int]:
                stats = embedded.stats()
                return stats.used_bytes, stats.capacity_bytes, stats.evictions

            call_timeout_s = None  # in-process: its calls wait on nothing outside the sidecar
        if faults is not None and faults.enabled:
            store = FaultyStore(store, faults)
        guarded = CircuitBreakerStore(
            store,
            call_timeout_s=call_timeout_s,
            failure_threshold=config.breaker.failure_threshold,
            reset_after_s=config.breaker.reset_after_s,
        )
        try:
            yield OpenStore(guarded, usage, answers_at_once=answers_at_once(
                config.backend, faults_on=isinstance(store, FaultyStore)),
                reads_here=reads_here, disk=disk, where=where)
        finally:
            with anyio.CancelScope(shield=True):
                await guarded.aclose()


@dataclasses.dataclass(frozen=True)
class Backends:
    store: KVStore
    breaker: CircuitBreakerStore
    """The breaker every store call passes (``store`` may wrap it)."""
    usage: Usage | None
    pool: StagingPool
    memory: BatchMemory
    save_copy: CopyEngine
    load_copy: CopyEngine
    """Loads copy on threads of their own: a load never waits behind a save's copy."""
    answers_at_once: bool
    """The store's queries wait on nothing (``OpenStore.answers_at_once``)."""
    in_place: PiecewiseKVStore | None = None
    """The store that moves values straight from and into engine memory, which must be
    registered with it while mapped; None: values are copied."""
    reads_here: ReadsHere | None = None
    """``OpenStore.reads_here``."""
    disk: DiskTier | None = None
    """``OpenStore.disk``."""
    where: Callable[[str], str] | None = None
    """``OpenStore.where``."""


def answers_at_once(backend: str, *, faults_on: bool) -> bool:
    """Whether the store's calls wait on nothing: the embedded store, in this process,
    with no fault points to delay them (``OpenStore.answers_at_once``)."""
    return backend == "embedded" and not faults_on


def moves_in_place(config: Config) -> bool:
    """Whether values move straight between engine memory and the store: Mooncake's
    multi-buffer calls, for native values of CPU engines."""
    return (config.store.backend == "mooncake" and config.store.mooncake.in_place
            and config.store.value_format == "native"
            and config.stages.transfer.device == "cpu")


@contextlib.asynccontextmanager
async def open_backends(
    config: Config, faults: Faults, on_evicted: Evicted, on_moved: Moved | None = None,
) -> AsyncIterator[Backends]:
    staging = config.staging
    transfer = config.stages.transfer
    pool = StagingPool(staging.pool_bytes, staging.slot_bytes, load_slots=staging.load_slots)
    with contextlib.ExitStack() as held:
        pin: Pin | None = None
        if transfer.device == "cuda":
            pin = _cuda_pin()
            held.enter_context(pin(pool.buffer))
        async with open_store(config.store, faults, on_evicted, pin, on_moved) as opened:
            guarded = opened.store
            await guarded.register_buffer(pool.buffer)
            store: KVStore = guarded
            memory: BatchMemory
            in_place = moves_in_place(config)
            skip_when_full = transfer.overflow == "skip"
            # Copies are written around the caches where what they write is cold
            # (``CpuCopyEngine``): a large load lands in blocks the engine took from its
            # free queue (LOAD_STREAM_BYTES); a save into a staging slot, used a moment
            # ago, goes through the caches.
            save_stream_bytes: int | None = None
            if in_place:
                helpers = None
                if transfer.threads > 1:
                    # The threads the copies would have: the store's thread is one.
                    helpers = HelperThreads(transfer.threads - 1)
                    held.callback(helpers.close)
                memory = InPlaceMemory(pool, guarded, skip_when_full=skip_when_full,
                                       helpers=helpers)
            elif config.store.backend == "embedded":
                # The embedded store lends its memory: values are copied straight into
                # and out of it, one copy instead of two through staging. Nobody else
                # reads it, so a vllm-format value keeps its checksum after it. A value
                # saved lands where the oldest ones were evicted: no cache holds it.
                memory = LentMemory(guarded)
                save_stream_bytes = 0
            else:
                if config.store.value_format == "vllm" and config.store.checksum:
                    store = ChecksumBesideStore(
                        guarded, require=config.store.verify == "required")
                memory = StagingMemory(pool, store, skip_when_full=skip_when_full)
                pool.touch()
            cuda_helpers = None
            if transfer.device == "cuda" and transfer.threads > 1:
                # The CPU's part of a GPU copy is the checksums: shared like in-place ones.
                cuda_helpers = HelperThreads(transfer.threads - 1)
                held.callback(cuda_helpers.close)
            save_threads = WorkerThreads(transfer.threads, name="kvsidecar-save",
                                         nice=transfer.save_nice)
            load_threads = WorkerThreads(transfer.threads, name="kvsidecar-load")
            held.callback(save_threads.close)
            held.callback(load_threads.close)
            yield Backends(store, guarded, opened.usage, pool, memory,
                           save_copy=_copy_engine(transfer, save_threads, in_place=in_place,
                                                  inline_bytes=INLINE_BYTES,
                                                  stream_bytes=save_stream_bytes,
                                                  helpers=cuda_helpers),
                           load_copy=_copy_engine(transfer, load_threads, in_place=in_place,
                                                  inline_bytes=LOAD_INLINE_BYTES,
                                                  stream_bytes=LOAD_STREAM_BYTES,
                                                  helpers=cuda_helpers),
                           answers_at_once=opened.answers_at_once,
                           in_place=guarded if in_place else None,
                           reads_here=opened.reads_here, disk=opened.disk,
                           where=opened.where)


def _copy_engine(transfer: TransferStageConfig, threads: WorkerThreads, *,
                 in_place: bool, inline_bytes: int, stream_bytes: int | None,
                 helpers: HelperThreads | None) -> CopyEngine:
    """One direction's copy engine, with threads (and streams) of its own; batches up to
    ``inline_bytes`` are copied on the event loop, and from ``stream_bytes`` on written
    around the caches; ``helpers`` share the checksums of GPU copies."""
    if in_place:
        return InPlaceCopyEngine()
    cpu = CpuCopyEngine(threads, inline_bytes=inline_bytes, stream_bytes=stream_bytes)
    if transfer.device == "cpu":
        return cpu
    from pipeline.backends.cuda_copy import CudaCopyEngine

    return CudaCopyEngine(cpu, anyio.CapacityLimiter(transfer.threads),
                          streams=transfer.cuda_streams, helpers=helpers)


def _cuda_pin() -> Pin:
    if not torch.cuda.is_available():
        raise ConfigError(
            f"store.engine_memory is cuda, but torch {torch.__version__} sees no CUDA device"
        )
    from pipeline.backends.cuda_copy import pinned

    return pinned
