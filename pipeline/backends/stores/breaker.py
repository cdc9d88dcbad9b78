"""A circuit breaker around any store: a store that is down costs nothing to ask.

After ``failure_threshold`` consecutive failures or timeouts the circuit opens: every call
fails at once with ``StoreUnavailable`` (saves are skipped with that reason, lookups
answer "miss"), so no request waits out a timeout. After ``reset_after_s`` one call is
let through; its success closes the circuit again, its failure re-opens it.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import structlog

from pipeline.backends.stores.wrapper import StoreWrapper
from pipeline.core.errors import StoreError, StoreUnavailable
from pipeline.core.store import KVStore

__all__ = ["BreakerState", "CircuitBreakerStore"]

T = TypeVar("T")
log = structlog.get_logger("kvsidecar.store")


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreakerStore(StoreWrapper):
    """Wraps a ``KVStore``; the same contract, with timeouts and fast failure.

    ``call_timeout_s`` None: no deadline of the breaker's own, for a store whose calls
    never wait on anything outside this process (the embedded store), where the cancel
    scope of a deadline would cost more than the call it guards."""

    def __init__(
        self,
        inner: KVStore,
        *,
        call_timeout_s: float | None,
        failure_threshold: int = 3,
        reset_after_s: float = 2.0,
    ) -> None:
        super().__init__(inner)
        self._timeout_s = call_timeout_s
        self._threshold = failure_threshold
        self._reset_after_s = reset_after_s
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self.state = BreakerState.CLOSED

    async def _around(self, name: str, call: Callable[[], Awaitable[T]]) -> T:
        if self.state is BreakerState.OPEN:
            if anyio.current_time() - self._opened_at < self._reset_after_s or self._probing:
                raise StoreUnavailable("the store is unavailable (circuit open)")
            self.state = BreakerState.HALF_OPEN
        probing = self.state is BreakerState.HALF_OPEN
        self._probing = probing
        try:
            if self._timeout_s is None:
                result = await call()
            else:
                with anyio.fail_after(self._timeout_s):
                    result = await call()
        except (StoreError, TimeoutError) as exc:
            self._record_failure(name, exc)
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"store {name} timed out after {self._timeout_s}s") from exc
        finally:
            if probing:
                self._probing = False
        if self.state is not BreakerState.CLOSED or self._failures:
            log.info("store.circuit.closed", after_failures=self._failures)
        self._failures = 0
        self.state = BreakerState.CLOSED
        return result

    def _record_failure(self, name: str, exc: BaseException) -> None:
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or self._failures >= self._threshold:
            if self.state is not BreakerState.OPEN:
                log.warning(
                    "store.circuit.opened", call=name, failures=self._failures, error=str(exc)
                )
            self.state = BreakerState.OPEN
            self._opened_at = anyio.current_time()
