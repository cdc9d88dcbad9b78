"""The circuit breaker around a store: fail fast while down, recover by itself."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
import torch

from pipeline.backends.stores.breaker import BreakerState, CircuitBreakerStore
from pipeline.backends.stores.embedded import EmbeddedStore
from pipeline.core.config import EmbeddedStoreConfig
from pipeline.core.errors import StoreError, StoreUnavailable
from pipeline.core.outcomes import STORE_UNAVAILABLE, BlockStatus, KeyOutcome, store_error_outcome
from pipeline.core.store import Presence


class FlakyStore(EmbeddedStore):
    """A real embedded store that can be switched down (raising) or slow (hanging)."""

    def __init__(self) -> None:
        super().__init__(EmbeddedStoreConfig(capacity_bytes=1 << 20))
        self.down = False
        self.slow = False
        self.calls = 0

    async def exists(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Presence]:
        self.calls += 1
        if self.down:
            raise StoreError("connection refused")
        if self.slow:
            await anyio.sleep(10)
        return await super().exists(keys, sizes)

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        self.calls += 1
        if self.down:
            raise StoreError("connection refused")
        return await super().put(keys, values)


async def test_circuit_opens_after_threshold_and_then_fails_without_calling() -> None:
    """After N failures calls fail at once with StoreUnavailable, never reaching the store."""
    inner = FlakyStore()
    store = CircuitBreakerStore(inner, call_timeout_s=1, failure_threshold=2, reset_after_s=60)
    inner.down = True
    for _ in range(2):
        with pytest.raises(StoreError):
            await store.exists(["k"], [1])
    assert store.state is BreakerState.OPEN
    calls = inner.calls
    with pytest.raises(StoreUnavailable):
        await store.exists(["k"], [1])
    assert inner.calls == calls


async def test_timeouts_count_as_failures() -> None:
    """A store that hangs is cut off by the call timeout and opens the circuit."""
    inner = FlakyStore()
    store = CircuitBreakerStore(inner, call_timeout_s=0.05, failure_threshold=1, reset_after_s=60)
    inner.slow = True
    with anyio.fail_after(5), pytest.raises(StoreError, match="timed out"):
        await store.exists(["k"], [1])
    assert store.state is BreakerState.OPEN


async def test_circuit_closes_after_a_successful_probe() -> None:
    """Once the reset delay has passed, one successful call closes the circuit."""
    inner = FlakyStore()
    store = CircuitBreakerStore(inner, call_timeout_s=1, failure_threshold=1, reset_after_s=0.05)
    inner.down = True
    with pytest.raises(StoreError):
        await store.exists(["k"], [1])
    inner.down = False
    await anyio.sleep(0.06)
    value = torch.ones(16, dtype=torch.uint8)
    assert (await store.put(["k"], [value]))[0].status is BlockStatus.STORED
    assert store.state is BreakerState.CLOSED
    assert await store.exists(["k"], [16]) == [Presence.PRESENT]


async def test_a_failed_probe_reopens_the_circuit() -> None:
    """A probe that fails re-opens the circuit for another reset delay."""
    inner = FlakyStore()
    store = CircuitBreakerStore(inner, call_timeout_s=1, failure_threshold=1, reset_after_s=0.05)
    inner.down = True
    with pytest.raises(StoreError):
        await store.exists(["k"], [1])
    await anyio.sleep(0.06)
    with pytest.raises(StoreError):
        await store.exists(["k"], [1])  # the probe
    with pytest.raises(StoreUnavailable):
        await store.exists(["k"], [1])


def test_saves_are_skipped_and_loads_failed_while_unavailable() -> None:
    """An open circuit skips saves with a reason; loads fail so the engine recomputes."""
    down = StoreUnavailable("down")
    assert store_error_outcome(down, saving=True) == STORE_UNAVAILABLE
    assert store_error_outcome(down, saving=False).status is BlockStatus.FAILED
    assert store_error_outcome(StoreError("boom"), saving=True).status is BlockStatus.FAILED
