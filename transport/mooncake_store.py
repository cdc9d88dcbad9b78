"""The Mooncake distributed store as a ``KVStore`` (mooncake-transfer-engine's Python client),
opened by ``transport.mooncake_setup.open_mooncake_store``.

Values move zero-copy: staging buffers are registered with Mooncake once, and every put
and get names byte ranges inside them (``batch_put_from`` / ``batch_get_into``). Engine
memory is registered too while a session maps it, and a value made of several ranges
(an engine block's pages, then its checksum) moves in one call
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``). Every
blocking Mooncake call runs in a worker thread under a ``CapacityLimiter`` and is
bounded by ``call_timeout_s``. A call that overruns it is abandoned, and since its
thread may still read or write staging memory later, it raises ``StoreCallAbandoned``
(the stages withhold its staging slot until it returns) and the store refuses all
further calls until every abandoned call has returned: late bytes must never meet a
buffer that was handed out again. The client's own RPC timeout (30 s) ends a call to a
master that stopped answering, so the store serves again by itself. For the same
reason a cancelled caller is only released once its call has returned (or timed out).

Mooncake facts this module relies on (0.3.13):

- A put of a key that already exists returns 0 and keeps the old bytes, so ``PRESENT``
  comes from a ``batch_is_exist`` pre-check; -705 (object already exists) is mapped
  too, for masters that report it.
- A get returns the value's size on success (a larger buffer is partly filled; larger
  pieces of a multi-buffer get fail with -800), -704 when the key is missing, -600 when
  the buffer is too small, and -707 when the read lease expired before the transfer
  finished.
- A put, a presence check and a get each take a lease on the object
  (``kv_lease_ttl_ms``), and removing an object under a lease fails with -706 unless
  forced. ``remove`` is asked only for values that failed their checksum, right after
  the get that found them (whose lease still holds), so it forces: a reader it pulls
  the value from under fails the same check. Objects are also evicted by the master
  once segments fill up, only those whose lease has ended.
- -200 (no available handle) means no segment has room: the put is skipped.
- When the master is gone, every key of a batch comes back -900 (RPC failure); when it
  hangs, the client's own RPC timeout (30 s) ends the call with -901. Codes from -999
  to -900 are RPC errors.
- The ``batch_*`` calls release the GIL; ``setup``, ``register_buffer`` and ``close`` hold
  it, so no timeout can interrupt them and they stall the event loop while they run
  (setup: ~1 s for a 256 MiB segment; close: 1-2 s, longer when the master is gone;
  ``register_buffer`` and ``unregister_buffer`` with tcp: well under a millisecond, so
  engine memory is registered on the event loop).
- A multi-buffer put or get moves one value as the concatenation of its buffers, with
  the codes of the single-buffer calls (a get returns the bytes read, their total).
- ``batch_get_replica_desc`` takes a read lease on each object it describes, as a get
  does, and describes only complete objects. A memory replica's descriptor names the
  segment's owner (``transport_endpoint``, ``get_hostname()`` for this client's own) and
  where the bytes lie in that owner's memory (``buffer_address``).
  Setup retries an unreachable master for ~90 s, hence the TCP probe before it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy
import structlog
import torch
from anyio.abc import AsyncResource

from pipeline.backends.threads import WorkerThreads
from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.errors import StoreCallAbandoned, StoreError
from pipeline.core.outcomes import PRESENT, STORED, KeyOutcome, failed
from pipeline.core.store import PRESENCE_OUTCOMES, Pieces, Presence, ReadHere, Seal
from transport.mooncake_codes import (
    LEASE_EXPIRED,
    OBJECT_NOT_FOUND,
    OK,
    RPC_ERRORS,
    get_outcome,
    put_outcome,
)
from transport.mooncake_master import EmbeddedMaster

__all__ = ["MooncakeClient", "MooncakeStore"]

log = structlog.get_logger("kvsidecar.store.mooncake")

T = TypeVar("T")
P = TypeVar("P", int, list[int])
"""Where a value lies: one address, or one per piece."""


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
        self._limiter = anyio.CapacityLimiter(config.max_concurrent_calls)
        # Only ever given calls by holders of a _limiter slot, so a call never queues for
        # a thread (a queue would count as call time), and off anyio's shared pool, whose
        # hand-off costs the event loop twice as much (``WorkerThreads``).
        self._threads = WorkerThreads(config.max_concurrent_calls, name="kvsidecar-mooncake")
        self._registered: list[tuple[int, int, torch.Tensor]] = []
        self._memory: dict[tuple[int, int], int] = {}  # engine memory -> registrations
        self._busy = 0  # calls inside the client, abandoned ones included
        self._busy_lock = threading.Lock()
        self._abandoned = 0  # calls past their timeout that have not returned yet
        self._when_returned: list[Callable[[], None]] = []
        self._unusable: str | None = None
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
        _check_staging(buffer, "buffer")
        start, size = buffer.data_ptr(), buffer.numel()
        if self._registered_range(start, size):
            return
        rc = await self._call("register_buffer", self._client.register_buffer, start, size)
        if rc != OK:
            raise StoreError(f"mooncake register_buffer of {size} bytes failed with code {rc}")
        self._registered.append((start, start + size, buffer))

    def register_memory(self, memory: torch.Tensor) -> None:
        _check_staging(memory, "engine memory")
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
        if self._abandoned:
            self._when_returned.append(callback)
        else:
            callback()

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
        return await self._call("batch_is_exist", self._presence, list(keys), list(sizes))

    def _presence(self, keys: list[str], sizes: list[int]) -> list[Presence]:
        """In a worker thread: which keys exist, then the sizes of those that do (asking
        only for present keys: the client logs an error for every missing one)."""
        codes = self._client.batch_is_exist(keys)
        self._raise_if_unreachable("batch_is_exist", codes)
        result = [Presence.PRESENT if code == 1 else Presence.ABSENT for code in codes]
        present = [key for key, code in zip(keys, codes, strict=True) if code == 1]
        if not present:
            return result
        stored = _value_sizes(self._client.batch_get_replica_desc(present))
        for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            # A key gone between the two calls has no size: absent, as a get would find.
            if result[index] is Presence.PRESENT and stored.get(key) != size:
                result[index] = Presence.ABSENT if key not in stored else Presence.FOREIGN
        return result

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        batch = self._prepare(keys, values)
        if batch.keys:
            op = "batch_put_from"
            outcomes = await self._call(
                op, self._put_absent, batch, batch.sizes, op, self._client.batch_put_from
            )
            for i, outcome in zip(batch.index, outcomes, strict=True):
                batch.outcomes[i] = outcome
        return _complete(batch.outcomes)

    async def put_pieces(
        self, keys: Sequence[str], values: Pieces, *, seal: Seal | None = None
    ) -> list[KeyOutcome]:
        batch = self._prepare_pieces(keys, values)
        if batch.keys:
            op = "batch_put_from_multi_buffers"
            outcomes = await self._call(
                op, self._put_absent, batch, [sum(sizes) for sizes in batch.sizes], op,
                self._client.batch_put_from_multi_buffers, seal,
            )
            for i, outcome in zip(batch.index, outcomes, strict=True):
                batch.outcomes[i] = outcome
        return _complete(batch.outcomes)

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        batch = self._prepare(keys, buffers)
        if batch.keys:
            codes = await self._call(
                "batch_get_into", self._client.batch_get_into, batch.keys, batch.ptrs, batch.sizes
            )
            self._raise_if_unreachable("batch_get_into", codes)
            for i, code, size in zip(batch.index, codes, batch.sizes, strict=True):
                batch.outcomes[i] = get_outcome(code, size)
        return _complete(batch.outcomes)

    async def get_pieces_into(
        self, keys: Sequence[str], buffers: Pieces, *, measure: Seal | None = None,
        read: ReadHere | None = None,
    ) -> list[KeyOutcome]:
        batch = self._prepare_pieces(keys, buffers)
        if batch.keys:
            codes = await self._call(
                "batch_get_into_multi_buffers", self._get_measured, batch, measure, read)
            for i, code, sizes in zip(batch.index, codes, batch.sizes, strict=True):
                batch.outcomes[i] = get_outcome(code, sum(sizes))
        return _complete(batch.outcomes)

    async def remove(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        codes = await self._call("batch_remove", self._client.batch_remove, list(keys), True)
        self._raise_if_unreachable("batch_remove", codes)
        return sum(code == OK for code in codes)

    async def aclose(self) -> None:
        """Close the client, then the embedded master if there is one; idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self._config.close_timeout_s) as scope:
                while self._busy:  # noqa: ASYNC110 - counted by worker threads, no event
                    await anyio.sleep(_BUSY_POLL_S)
                # close() holds the GIL, so this bounds the wait above, not close itself.
                await anyio.to_thread.run_sync(self._client.close, abandon_on_cancel=True)
            if scope.cancelled_caught:
                log.warning(
                    "store.mooncake.close.timeout",
                    timeout_s=self._config.close_timeout_s,
                    calls_inside=self._busy,
                )
                if self._busy:
                    # Destroying the client under a running call could crash the process.
                    _ABANDONED_CLIENTS.append(self._client)
            self._threads.close(wait=not self._busy)
            self._registered.clear()
            if self._master is not None:
                await self._master.aclose()
        log.info("store.mooncake.closed", master=self._master_address)

    async def _call(self, op: str, func: Callable[..., T], *args: Any) -> T:
        # Waiting for a slot may be cancelled and does not count against the timeout.
        # A free slot is taken at once: anyio's acquire would first let everything
        # ready on the event loop run, once per store call.
        try:
            self._limiter.acquire_nowait()
        except anyio.WouldBlock:
            await self._limiter.acquire()
        try:
            if self._closed:
                raise StoreError("the mooncake store is closed")
            if self._unusable is not None:
                raise StoreError(self._unusable)
            call = _Call(asyncio.get_running_loop())
            with self._busy_lock:
                self._busy += 1  # the worker thread takes it back when func returns
            # Shielded: a cancelled caller must not abandon a thread that may still write
            # into staging memory. The call is bounded by call_timeout_s instead.
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self._config.call_timeout_s) as deadline:
                    [result] = await self._threads.submit(
                        [functools.partial(self._run, call, func, *args)])
        finally:
            self._limiter.release()
        if deadline.cancelled_caught:
            self._abandoned += 1
            self._unusable = (
                f"mooncake {op} did not return within {self._config.call_timeout_s}s "
                f"(store.mooncake.call_timeout_s); the store refuses calls until it returns: "
                f"check the master at {self._master_address} and the network"
            )
            log.error("store.mooncake.call.timeout", op=op, master=self._master_address)
            with self._busy_lock:
                call.abandoned = True
                returned = call.returned
            if returned:  # between the deadline and now
                self._returned(call)
            raise StoreCallAbandoned(self._unusable, call.when_returned)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    def _run(self, call: _Call, func: Callable[..., T], *args: Any) -> T:
        """In a worker thread: the call, then one less call inside the client; if the
        caller gave up on it meanwhile, the event loop hears that it has returned."""
        try:
            return func(*args)
        finally:
            with self._busy_lock:
                self._busy -= 1
                call.returned = True
                abandoned = call.abandoned
            if abandoned:
                # Not waited for: the loop may be shutting down and never run it.
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    call.loop.call_soon_threadsafe(self._returned, call)

    def _returned(self, call: _Call) -> None:
        """On the event loop: an abandoned call has returned; once none is left inside
        the client, the store serves again."""
        call.settle()
        self._abandoned -= 1
        if not self._abandoned and self._unusable is not None:
            self._unusable = None
            log.warning("store.mooncake.recovered", master=self._master_address)
        if not self._abandoned:
            callbacks, self._when_returned = self._when_returned, []
            for callback in callbacks:
                callback()

    def _raise_if_unreachable(self, op: str, codes: Sequence[int]) -> None:
        if codes and all(code in RPC_ERRORS for code in codes):
            raise StoreError(
                f"mooncake {op} failed with RPC errors ({codes[0]}) for every key: the master at "
                f"{self._master_address} is unreachable; check that mooncake_master runs there"
            )

    def _registered_range(self, start: int, size: int) -> bool:
        return any(low <= start and start + size <= high for low, high, _ in self._registered)

    def _prepare(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> _Batch[int]:
        # On the hot path: a few comprehensions over the blocks, no per-block branching
        # unless some value is refused.
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        ptrs = [value.data_ptr() for value in values]
        sizes = [value.numel() for value in values]
        malformed = [i for i, value in enumerate(values) if not _is_flat_bytes(value)]
        ranges = [(low, high) for low, high, _ in self._registered]
        outside = _outside(ptrs, sizes, ranges)
        return _batch(keys, ptrs, sizes, malformed, outside)

    def _prepare_pieces(self, keys: Sequence[str], pieces: Pieces) -> _Batch[list[int]]:
        """As ``_prepare``, for values of several pieces: a value is refused when any of
        its pieces is. A batch has thousands of pages, so they are checked a column at a
        time (one page of every value): a column whose lowest and highest page lie in
        one registered range is inside it whole."""
        if len(keys) != len(pieces):
            raise ValueError(f"{len(keys)} keys but {len(pieces)} values")
        ranges = [(low, high) for low, high, _ in self._registered]
        starts = pieces.addresses
        sizes = list(pieces.sizes)
        malformed: list[int] = []
        rows = pieces.trailers
        if rows is not None:  # one piece more per value: its trailer, a column more
            if rows.dim() != 2 or rows.shape[0] != len(keys):
                raise ValueError(f"{len(keys)} keys but trailers of shape {tuple(rows.shape)}")
            if rows.dtype is not torch.uint8 or rows.stride(1) != 1:
                malformed = list(range(len(keys)))
            trailers = rows.data_ptr() + rows.stride(0) * numpy.arange(len(keys))
            starts = numpy.column_stack([starts, trailers])
            sizes.append(rows.shape[1])
        ptrs: list[list[int]] = starts.tolist()
        outside: list[int] = []
        if ptrs and not _columns_inside(starts, sizes, ranges):
            outside = [i for i, value in enumerate(ptrs) if _outside(value, sizes, ranges)]
        return _batch(keys, ptrs, [sizes] * len(keys), malformed, outside)

    def _put_absent(
        self, batch: _Batch[P], totals: list[int], op: str,
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


    def _get_measured(self, batch: _Batch[list[int]], measure: Seal | None,
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


    def _read_here(self, batch: _Batch[list[int]], read: ReadHere) -> list[int] | None:
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
            address = self._address_here(descriptors, total)
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

    def _address_here(self, descriptors: list[Any], size: int) -> int | None:
        """Where a value of ``size`` bytes lies in this process: a memory replica in
        this client's own segment, wholly inside it (None: no such replica)."""
        for descriptor in descriptors:
            if not descriptor.is_memory_replica():
                continue
            buffer = descriptor.get_memory_descriptor().buffer_descriptor
            address = int(buffer.buffer_address)
            if (buffer.transport_endpoint == self._hostname and int(buffer.size) == size
                    and not _outside([address], [size], self._here)):
                return address
        return None


def _value_sizes(replicas: dict[str, list[Any]]) -> dict[str, int]:
    """Each key's value size, from its first replica the client describes."""
    sizes: dict[str, int] = {}
    for key, descriptors in replicas.items():
        for descriptor in descriptors:
            if descriptor.is_memory_replica():
                sizes[key] = int(descriptor.get_memory_descriptor().buffer_descriptor.size)
                break
            if descriptor.is_disk_replica():
                sizes[key] = int(descriptor.get_disk_descriptor().object_size)
                break
    return sizes


@dataclass(slots=True, eq=False)
class _Call:
    """One call inside the client, as its worker thread and the event loop see it."""

    loop: asyncio.AbstractEventLoop
    """The event loop that made the call (the sidecar runs on asyncio, as pyzmq's
    asyncio sockets require)."""
    returned: bool = False
    abandoned: bool = False
    settled: bool = False
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    def when_returned(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the event loop once the call has returned."""
        if self.settled:
            callback()
        else:
            self.callbacks.append(callback)

    def settle(self) -> None:
        self.settled = True
        for callback in self.callbacks:
            callback()
        self.callbacks.clear()


@dataclass(slots=True)
class _Batch(Generic[P]):
    """One call's keys: an outcome slot for each, byte ranges for those that passed checks."""

    outcomes: list[KeyOutcome | None]
    index: list[int]
    keys: list[str]
    ptrs: list[P]
    sizes: list[P]


def _batch(
    keys: Sequence[str], ptrs: list[P], sizes: list[P], malformed: list[int], outside: list[int]
) -> _Batch[P]:
    """The keys whose values passed the checks, the others refused with the reason."""
    if not malformed and not outside:
        return _Batch([None] * len(keys), list(range(len(keys))), list(keys), ptrs, sizes)
    refused: dict[int, KeyOutcome] = {i: failed("unregistered_buffer") for i in outside}
    refused.update((i, failed("bad_buffer")) for i in malformed)
    kept = [i for i in range(len(keys)) if i not in refused]
    return _Batch(
        [refused.get(i) for i in range(len(keys))],
        kept,
        [keys[i] for i in kept],
        [ptrs[i] for i in kept],
        [sizes[i] for i in kept],
    )


def _is_flat_bytes(value: torch.Tensor) -> bool:
    return value.dtype is torch.uint8 and (
        value.stride() == (1,) or (value.dim() == 1 and value.is_contiguous())
    )


def _outside(ptrs: list[int], sizes: list[int], ranges: list[tuple[int, int]]) -> list[int]:
    """Positions of the byte ranges that no registered buffer contains."""
    if len(ranges) == 1:
        ((low, high),) = ranges
        spans = enumerate(zip(ptrs, sizes, strict=True))
        return [i for i, (ptr, n) in spans if ptr < low or ptr + n > high]
    return [
        i
        for i, (ptr, n) in enumerate(zip(ptrs, sizes, strict=True))
        if not any(low <= ptr and ptr + n <= high for low, high in ranges)
    ]


def _columns_inside(
    starts: numpy.ndarray, sizes: Sequence[int], ranges: list[tuple[int, int]]
) -> bool:
    """Whether every column of ``starts`` (each page j of every value, ``sizes[j]``
    bytes) lies within one registered range, judged by its lowest and highest page.
    A column is looked for only in the range that starts last at or below its lowest
    page: registered ranges do not overlap, and a False sends the caller to the check
    value by value, which is exact either way. (Each column tried against every range
    took 43 µs for a batch of 24 pages a value and 25 ranges.)"""
    ordered = sorted(ranges)
    lows = [low for low, _ in ordered]
    columns = zip(starts.min(axis=0).tolist(), starts.max(axis=0).tolist(), sizes,
                  strict=True)
    for first, last, size in columns:
        index = bisect.bisect_right(lows, first) - 1
        if index < 0 or last + size > ordered[index][1]:
            return False
    return True


def _complete(outcomes: list[KeyOutcome | None]) -> list[KeyOutcome]:
    done = [outcome for outcome in outcomes if outcome is not None]
    assert len(done) == len(outcomes), "a key was left without an outcome"
    return done


def _check_staging(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"a Mooncake {what} must be a contiguous 1-D uint8 tensor")
