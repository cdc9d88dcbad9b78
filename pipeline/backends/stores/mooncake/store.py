"""The Mooncake distributed store as a ``KVStore`` (mooncake-transfer-engine's Python client),
opened by ``pipeline.backends.stores.mooncake.setup.open_mooncake_store``.

Values move zero-copy: staging buffers are registered with Mooncake once, and every put
and get names byte ranges inside them (``batch_put_from`` / ``batch_get_into``). Engine
memory is registered too while a session maps it, and a value made of several ranges
(an engine block's pages, then its checksum) moves in one call
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``). Every
blocking call goes through ``calls.Calls``: late bytes of an abandoned call never meet
a buffer that was handed out again.

What Mooncake itself does, which this module relies on, is in the docs
(``docs/mooncake.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread
import structlog
import torch
from anyio.abc import AsyncResource

from pipeline.backends.stores.mooncake.batches import (
    Batch,
    P,
    check_staging,
    complete,
    local_address,
    prepare,
    prepare_pieces,
    value_sizes,
)
from pipeline.backends.stores.mooncake.calls import Calls
from pipeline.backends.stores.mooncake.codes import (
    LEASE_EXPIRED,
    OBJECT_NOT_FOUND,
    OK,
    RPC_ERRORS,
    get_outcome,
    put_outcome,
)
from pipeline.backends.stores.mooncake.master import EmbeddedMaster
from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.errors import StoreError
from pipeline.core.outcomes import PRESENT, STORED, KeyOutcome
from pipeline.core.store import PRESENCE_OUTCOMES, Pieces, Presence, ReadHere, Seal

__all__ = ["MooncakeClient", "MooncakeStore"]

log = structlog.get_logger("kvsidecar.store.mooncake")



_BUSY_POLL_S = 0.01
_ABANDONED_CLIENTS: list[object] = []
"""Clients closed while a timed-out call was still inside: kept alive, never destroyed."""

class MooncakeClient(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` this backend uses."""

    def get_hostname(self) -> str: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any
    ) -> list[int]: ...
    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]],
        config: Any,
    ) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...
    def close(self) -> int: ...


class MooncakeStore(AsyncResource):
    """A ``KVStore`` over a set-up Mooncake client; build it with ``open_mooncake_store``."""

    def __init__(
        self,
        client: MooncakeClient,
        config: MooncakeStoreConfig,
        *,
        replicate_config: Any,
        master_address: str,
        master: EmbeddedMaster | None = None,
        here: Sequence[tuple[int, int]] = (),
    ) -> None:
        """``here``: where this client's own segment lies in this process's memory, as
        ``[start, end)`` ranges: a load whose values all lie there is copied from there
        (``get_pieces_into``'s ``read``). Empty: loads move through Mooncake's get."""
        self._client = client
        self._config = config
        self._replicate_config = replicate_config
        self._master_address = master_address
        self._master = master
        self._calls = Calls(config.max_concurrent_calls, config.call_timeout_s, master_address)
        self._registered: list[tuple[int, int, torch.Tensor]] = []
        self._memory: dict[tuple[int, int], int] = {}  # engine memory -> registrations
        self._closed = False
        self._here = list(here)
        self._hostname = client.get_hostname() if here else ""
        self._lease_s = config.kv_lease_ttl_ms / 1000
        self._values_read_here = [0, 0]  # values loaded, values read past their lease

    @property
    def master_address(self) -> str:
        return self._master_address

    @property
    def master(self) -> EmbeddedMaster | None:
        """The embedded master this store started and will stop, if any."""
        return self._master

    def reads_here(self) -> tuple[int, int]:
        """Values loads have read where they lie so far: (loaded, failed as read past
        their lease)."""
        loaded, late = self._values_read_here
        return loaded, late

    @property
    def raw_client(self) -> MooncakeClient:
        """The Mooncake client itself, for baselines and diagnostics; don't close it."""
        return self._client

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        check_staging(buffer, "buffer")
        start, size = buffer.data_ptr(), buffer.numel()
        if self._registered_range(start, size):
            return
        rc = await self._calls.call("register_buffer", self._client.register_buffer, start, size)
        if rc != OK:
            raise StoreError(f"mooncake register_buffer of {size} bytes failed with code {rc}")
        self._registered.append((start, start + size, buffer))

    def register_memory(self, memory: torch.Tensor) -> None:
        check_staging(memory, "engine memory")
        span = (memory.data_ptr(), memory.numel())
        if span not in self._memory:
            if self._closed:
                raise StoreError("the mooncake store is closed")
            rc = self._client.register_buffer(*span)
            if rc != OK:
                raise StoreError(
                    f"mooncake register_buffer of {span[1]} bytes of engine memory failed "
                    f"with code {rc}"
                )
            self._registered.append((span[0], span[0] + span[1], memory))
            log.info("store.mooncake.memory.registered", bytes=span[1])
        self._memory[span] = self._memory.get(span, 0) + 1

    def when_calls_returned(self, callback: Callable[[], None]) -> None:
        self._calls.when_returned(callback)

    def unregister_memory(self, memory: torch.Tensor) -> None:
        span = (memory.data_ptr(), memory.numel())
        count = self._memory.pop(span, 0) - 1
        if count > 0:
            self._memory[span] = count
            return
        if count < 0:
            return
        self._registered = [entry for entry in self._registered
                            if (entry[0], entry[1] - entry[0]) != span]
        if not self._closed:
            rc = self._client.unregister_buffer(span[0])
            if rc != OK:
                log.warning("store.mooncake.memory.unregister.failed", bytes=span[1], code=rc)
                return
        log.info("store.mooncake.memory.unregistered", bytes=span[1])

    async def exists(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Presence]:
        if not keys:
            return []
        return await self._calls.call("batch_is_exist", self._presence, list(keys), list(sizes))

    def _presence(self, keys: list[str], sizes: list[int]) -> list[Presence]:
        """In a worker thread: which keys exist, then the sizes of those that do (asking
        only for present keys: the client logs an error for every missing one)."""
        codes = self._client.batch_is_exist(keys)
        self._raise_if_unreachable("batch_is_exist", codes)
        result = [Presence.PRESENT if code == 1 else Presence.ABSENT for code in codes]
        present = [key for key, code in zip(keys, codes, strict=True) if code == 1]
        if not present:
            return result
        stored = value_sizes(self._client.batch_get_replica_desc(present))
        for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            # A key gone between the two calls has no size: absent, as a get would find.
            if result[index] is Presence.PRESENT and stored.get(key) != size:
                result[index] = Presence.ABSENT if key not in stored else Presence.FOREIGN
        return result

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        batch = self._prepare(keys, values)
        if batch.keys:
            op = "batch_put_from"
            outcomes = await self._calls.call(
                op, self._put_absent, batch, batch.sizes, op, self._client.batch_put_from
            )
            for i, outcome in zip(batch.index, outcomes, strict=True):
                batch.outcomes[i] = outcome
        return complete(batch.outcomes)

    async def put_pieces(
        self, keys: Sequence[str], values: Pieces, *, seal: Seal | None = None
    ) -> list[KeyOutcome]:
        batch = self._prepare_pieces(keys, values)
        if batch.keys:
            op = "batch_put_from_multi_buffers"
            outcomes = await self._calls.call(
                op, self._put_absent, batch, [sum(sizes) for sizes in batch.sizes], op,
                self._client.batch_put_from_multi_buffers, seal,
            )
            for i, outcome in zip(batch.index, outcomes, strict=True):
                batch.outcomes[i] = outcome
        return complete(batch.outcomes)

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        batch = self._prepare(keys, buffers)
        if batch.keys:
            codes = await self._calls.call(
                "batch_get_into", self._client.batch_get_into, batch.keys, batch.ptrs, batch.sizes
            )
            self._raise_if_unreachable("batch_get_into", codes)
            for i, code, size in zip(batch.index, codes, batch.sizes, strict=True):
                batch.outcomes[i] = get_outcome(code, size)
        return complete(batch.outcomes)

    async def get_pieces_into(
        self, keys: Sequence[str], buffers: Pieces, *, measure: Seal | None = None,
        read: ReadHere | None = None,
    ) -> list[KeyOutcome]:
        batch = self._prepare_pieces(keys, buffers)
        if batch.keys:
            codes = await self._calls.call(
                "batch_get_into_multi_buffers", self._get_measured, batch, measure, read)
            for i, code, sizes in zip(batch.index, codes, batch.sizes, strict=True):
                batch.outcomes[i] = get_outcome(code, sum(sizes))
        return complete(batch.outcomes)

    async def remove(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        codes = await self._calls.call("batch_remove", self._client.batch_remove, list(keys), True)
        self._raise_if_unreachable("batch_remove", codes)
        return sum(code == OK for code in codes)

    async def aclose(self) -> None:
        """Close the client, then the embedded master if there is one; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._calls.close()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self._config.close_timeout_s) as scope:
                while self._calls.busy:  # noqa: ASYNC110 - counted by worker threads, no event
                    await anyio.sleep(_BUSY_POLL_S)
                # close() holds the GIL, so this bounds the wait above, not close itself.
                await anyio.to_thread.run_sync(self._client.close, abandon_on_cancel=True)
            if scope.cancelled_caught:
                log.warning(
                    "store.mooncake.close.timeout",
                    timeout_s=self._config.close_timeout_s,
                    calls_inside=self._calls.busy,
                )
                if self._calls.busy:
                    # Destroying the client under a running call could crash the process.
                    _ABANDONED_CLIENTS.append(self._client)
            self._calls.threads.close(wait=not self._calls.busy)
            self._registered.clear()
            if self._master is not None:
                await self._master.aclose()
        log.info("store.mooncake.closed", master=self._master_address)

    def _raise_if_unreachable(self, op: str, codes: Sequence[int]) -> None:
        if codes and all(code in RPC_ERRORS for code in codes):
            raise StoreError(
                f"mooncake {op} failed with RPC errors ({codes[0]}) for every key: the master at "
                f"{self._master_address} is unreachable; check that mooncake_master runs there"
            )

    def _registered_range(self, start: int, size: int) -> bool:
        return any(low <= start and start + size <= high for low, high, _ in self._registered)

    def _prepare(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> Batch[int]:
        return prepare(keys, values, [(low, high) for low, high, _ in self._registered])

    def _prepare_pieces(self, keys: Sequence[str], pieces: Pieces) -> Batch[list[int]]:
        return prepare_pieces(keys, pieces, [(low, high) for low, high, _ in self._registered])

    def _put_absent(
        self, batch: Batch[P], totals: list[int], op: str,
        put: Callable[[list[str], list[P], list[P], Any], list[int]], seal: Seal | None = None,
    ) -> list[KeyOutcome]:
        """In a worker thread: the existence check and the put, in one hop. ``totals``:
        each value's size, which a key held already must hold to count as present;
        ``seal``: called with the caller's positions of the values to send, first."""
        present = self._presence(batch.keys, totals)
        first: dict[str, int] = {}  # key -> its first position, for keys to send
        for j, (key, presence) in enumerate(zip(batch.keys, present, strict=True)):
            if presence is Presence.ABSENT:
                first.setdefault(key, j)
        # Absent keys are sent; later copies of one in the batch are present once it is.
        outcomes = [PRESENCE_OUTCOMES.get(presence, PRESENT) for presence in present]
        if first:
            send = list(first.values())
            if seal is not None:
                seal([batch.index[j] for j in send])
            codes = put(
                [batch.keys[j] for j in send],
                [batch.ptrs[j] for j in send],
                [batch.sizes[j] for j in send],
                self._replicate_config,
            )
            self._raise_if_unreachable(op, codes)
            for j, code in zip(send, codes, strict=True):
                outcomes[j] = put_outcome(code)
            for j, key in enumerate(batch.keys):
                sent = first.get(key, j)
                if sent != j and outcomes[sent] not in (STORED, PRESENT):
                    outcomes[j] = outcomes[sent]  # a later copy shares its first's fate
        return outcomes


    def _get_measured(self, batch: Batch[list[int]], measure: Seal | None,
                      read: ReadHere | None) -> list[int]:
        """In a worker thread: the get, then ``measure`` of the values got whole (the
        caller's positions), in one hop; or, when every value found lies in this
        client's own segment, ``read`` of them from there (``_read_here``)."""
        if read is not None and self._here:
            codes = self._read_here(batch, read)
            if codes is not None:
                return codes
        codes = self._client.batch_get_into_multi_buffers(batch.keys, batch.ptrs, batch.sizes)
        self._raise_if_unreachable("batch_get_into_multi_buffers", codes)
        if measure is not None:
            measure([i for i, code, sizes in zip(batch.index, codes, batch.sizes, strict=True)
                     if code == sum(sizes)])
        return codes


    def _read_here(self, batch: Batch[list[int]], read: ReadHere) -> list[int] | None:
        """In a worker thread: every value found copied by ``read`` from where it lies
        in this client's own segment, with a get's codes (each value's size, or
        -704 missing). None, having copied nothing, when a value found lies elsewhere or
        has another size, or none was found: the get then moves the batch (it alone tells
        missing keys from a master that is gone). The descriptors take a read lease on
        each value, as the get would. A value copied after its lease may have ended may
        have been evicted and its memory reused meanwhile, so such a batch fails (-707,
        lease expired), as Mooncake's get fails a value whose lease ends before its
        transfer does."""
        totals = [sum(sizes) for sizes in batch.sizes]
        leased = time.monotonic()
        replicas = self._client.batch_get_replica_desc(batch.keys)
        if not replicas:
            return None
        codes: list[int] = []
        positions: list[int] = []
        sources: list[int] = []
        for position, key, total in zip(batch.index, batch.keys, totals, strict=True):
            descriptors = replicas.get(key)
            if not descriptors:
                codes.append(OBJECT_NOT_FOUND)
                continue
            address = local_address(descriptors, total, self._hostname, self._here)
            if address is None:
                return None
            codes.append(total)
            positions.append(position)
            sources.append(address)
        read(positions, sources)
        late = time.monotonic() - leased > self._lease_s / 2
        self._values_read_here[late] += len(positions)
        if late:
            return [LEASE_EXPIRED if code >= 0 else code for code in codes]
        return codes
