"""One side's connection to the sidecar: opened in the background, never waited for.

vLLM calls the connector from its engine loop; a sidecar that is down or slow must
never hold that loop. Until the link is up, and for ``retry_after_s`` after a call
failed, ``client()`` is None and the connector recomputes instead of asking. Once up,
the client itself re-registers when a restarted sidecar has forgotten it. A sidecar
that refuses the registration itself (the layout, the tensors, the protocol version),
twice in a row, is not asked again: ``refused`` says why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import structlog

from pipeline.core.errors import KVSidecarError, RequestRejected
from pipeline.core.messages import ErrorCode
from transport.client import BlockingEngineClient, InlineLookupClient
from transport.vllm.config import ConnectorConfig

__all__ = ["SidecarLink"]

log = structlog.get_logger("kvsidecar.vllm")

C = TypeVar("C", BlockingEngineClient, InlineLookupClient)

REFUSALS = frozenset({ErrorCode.BAD_LAYOUT, ErrorCode.BAD_TENSORS, ErrorCode.BAD_VERSION})
"""Registration errors that asking again cannot mend."""


class SidecarLink(Generic[C]):
    def __init__(
        self, config: ConnectorConfig, name: str, opens: Callable[..., C],
        connect_kwargs: Callable[[], dict[str, Any]],
    ) -> None:
        """``opens(endpoint, **kwargs)`` connects: the client class of the side."""
        self._config = config
        self._name = name
        self._opens: Callable[..., C] = opens
        self._connect_kwargs = connect_kwargs
        self._curve = config.curve()  # unreadable key files stop the engine now, not later
        self._lock = threading.Lock()
        self._client: C | None = None
        self._thread: threading.Thread | None = None
        self._down_until = 0.0
        self._closed = False
        self.refused: RequestRejected | None = None
        """Why the sidecar refused this side's registration, if it did."""

    def client(self) -> C | None:
        """The connected client, or None (then a connection is being made, or the
        sidecar failed within the last ``retry_after_s``)."""
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return None
            if self._client is None and self._thread is None:
                self._thread = threading.Thread(
                    target=self._connect, name=f"kvsidecar-{self._name}-connect", daemon=True
                )
                self._thread.start()
            return self._client

    @property
    def starting(self) -> bool:
        """The first connection is still being made (nothing has failed yet)."""
        with self._lock:
            # _down_until stays 0 until a first failure; a connected link has its client.
            return self._client is None and self._thread is not None and not self._down_until

    def failed(self, error: BaseException) -> None:
        """A call failed: leave the sidecar alone for a while."""
        with self._lock:
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self._config.retry_after_s
        if first:
            log.warning("vllm.sidecar.unavailable", side=self._name, error=str(error),
                        retry_after_s=self._config.retry_after_s)

    def _connect(self) -> None:
        for attempt in (1, 2):
            try:
                client = self._opens(
                    self._config.endpoint,
                    timeout_s=self._config.connect_timeout_s,
                    **self._connect_kwargs(),
                    **self._curve,
                )
                break
            except RequestRejected as exc:
                if exc.code not in REFUSALS:
                    self._connect_failed(exc)
                    return
                if attempt == 1:
                    continue  # a handover cut off by a sidecar restart: once more
                with self._lock:
                    self._thread, self._closed, self.refused = None, True, exc
                log.error("vllm.sidecar.refused", side=self._name, error=str(exc),
                          hint="this engine runs without the sidecar's hits")
                return
            except (KVSidecarError, OSError) as exc:
                self._connect_failed(exc)
                return
        with self._lock:
            self._thread = None
            if self._closed:
                closing: C | None = client
            else:
                self._client, closing = client, None
        if closing is not None:
            closing.close()
            return
        registered = client.registered
        log.info("vllm.sidecar.registered", side=self._name, endpoint=self._config.endpoint,
                 store_groups=registered.store_group_ids if registered else None)

    def _connect_failed(self, error: BaseException) -> None:
        with self._lock:
            self._thread = None
        self.failed(error)

    def wait_connected(self, timeout_s: float) -> C | None:
        """Wait up to ``timeout_s`` for the connection (tests and start-up checks); None
        at once once the registration was refused."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.refused is None:
            client = self.client()
            if client is not None:
                return client
            time.sleep(0.01)
        return None

    def close(self) -> None:
        """Unregister and disconnect; idempotent."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
