"""The backend choices, made once: the store (behind its decorators), the batch memory
and the copy engines every data stage is built with."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import anyio
import torch

from pipeline.backends.beside import ChecksumBesideStore
from pipeline.backends.breaker import CircuitBreakerStore
from pipeline.backends.cpu_copy import CpuCopyEngine
from pipeline.backends.faults import Faults, FaultyStore
from pipeline.backends.memory import LentMemory, StagingMemory
from pipeline.backends.staging import StagingPool
from pipeline.core.config import Config, StoreConfig, TransferStageConfig
from pipeline.core.errors import ConfigError
from pipeline.core.seams import BatchMemory, CopyEngine
from pipeline.core.store import KVStore
from pipeline.state.events import KVEventLog

__all__ = ["Backends", "open_backends", "open_store"]


Pin = Callable[[torch.Tensor], contextlib.AbstractContextManager[None]]
"""Page-locks host memory for device copies while entered."""


@contextlib.asynccontextmanager
async def open_store(
    config: StoreConfig, faults: Faults | None, events: KVEventLog, pin: Pin | None = None,
) -> AsyncIterator[CircuitBreakerStore]:
    """The configured store backend behind a circuit breaker (and fault points, if any),
    closed on exit. ``events`` hears of the embedded store's evictions; ``pin`` pins its
    memory, which GPU blocks are copied into and out of."""
    with contextlib.ExitStack() as pinned:
        store: KVStore
        call_timeout_s: float | None = config.breaker.call_timeout_s
        if config.backend == "mooncake":
            from transport.mooncake_setup import open_mooncake_store

            store = await open_mooncake_store(config.mooncake)
        else:
            from transport.embedded_store import EmbeddedStore

            embedded = EmbeddedStore(config.embedded, on_evicted=events.removed)
            if pin is not None:
                pinned.enter_context(pin(embedded.memory))
            store = embedded
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
            yield guarded
        finally:
            with anyio.CancelScope(shield=True):
                await guarded.aclose()


@dataclasses.dataclass(frozen=True)
class Backends:
    store: KVStore
    pool: StagingPool
    memory: BatchMemory
    save_copy: CopyEngine
    load_copy: CopyEngine
    """Loads copy on threads of their own: a load never waits behind a save's copy."""


@contextlib.asynccontextmanager
async def open_backends(
    config: Config, faults: Faults, events: KVEventLog
) -> AsyncIterator[Backends]:
    staging = config.staging
    transfer = config.stages.transfer
    pool = StagingPool(staging.pool_bytes, staging.slot_bytes, load_slots=staging.load_slots)
    with contextlib.ExitStack() as held:
        pin: Pin | None = None
        if transfer.device == "cuda":
            pin = _cuda_pin()
            held.enter_context(pin(pool.buffer))
        async with open_store(config.store, faults, events, pin) as guarded:
            await guarded.register_buffer(pool.buffer)
            store: KVStore = guarded
            memory: BatchMemory
            if config.store.backend == "embedded":
                # The embedded store lends its memory: values are copied straight into
                # and out of it, one copy instead of two through staging. Nobody else
                # reads it, so a vllm-format value keeps its checksum after it.
                memory = LentMemory(guarded)
            else:
                if config.store.value_format == "vllm" and config.store.checksum:
                    store = ChecksumBesideStore(
                        guarded, require=config.store.verify == "required")
                memory = StagingMemory(pool, store, skip_when_full=transfer.overflow == "skip")
            yield Backends(store, pool, memory, save_copy=_copy_engine(transfer),
                           load_copy=_copy_engine(transfer))


def _copy_engine(transfer: TransferStageConfig) -> CopyEngine:
    """One direction's copy engine, with threads (and streams) of its own."""
    cpu = CpuCopyEngine(anyio.CapacityLimiter(transfer.threads))
    if transfer.device == "cpu":
        return cpu
    from pipeline.backends.cuda_copy import CudaCopyEngine

    return CudaCopyEngine(cpu, anyio.CapacityLimiter(transfer.threads),
                          streams=transfer.cuda_streams)


def _cuda_pin() -> Pin:
    if not torch.cuda.is_available():
        raise ConfigError(
            f"stages.transfer.device is cuda, but torch {torch.__version__} sees no CUDA "
            "device"
        )
    from pipeline.backends.cuda_copy import pinned

    return pinned
