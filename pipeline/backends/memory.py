"""The batch memories: where a batch's values live between the copy and the store.

``StagingMemory`` holds them in a staging slot and moves them with the store's batch
calls (Mooncake: zero-copy from the registered pool). ``LentMemory`` writes and reads
them in the store's own memory (the embedded store), sparing one copy each way.
``InPlaceMemory`` leaves them in the engine's blocks: the store moves each value
straight from its pages and into them (Mooncake's multi-buffer calls), and only the
checksums live in a staging slot.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar, cast

import anyio

from pipeline.backends.cpu_copy import page_addresses
from pipeline.backends.in_place_copy import HelperThreads, read_in_place, seal_in_place
from pipeline.backends.staging import Slot, StagingPool
from pipeline.core.errors import StoreCallAbandoned, StoreError
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.integrity import CHECKSUM_BYTES
from pipeline.core.outcomes import STORED, BlockStatus, KeyOutcome, store_error_outcome
from pipeline.core.runs import Run, held, value_views
from pipeline.core.seams import Values
from pipeline.core.store import (
    DirectKVStore,
    Extents,
    KVStore,
    Pieces,
    PiecewiseKVStore,
    ReadHere,
    Seal,
)

__all__ = ["STAGING_FULL", "InPlaceMemory", "LentMemory", "StagingMemory", "per_key_outcomes"]

STAGING_FULL = KeyOutcome(BlockStatus.SKIPPED, "staging_full")
NOT_ADMITTED = KeyOutcome(BlockStatus.FAILED, "not_admitted")
"""A fetch whose caller withdrew it before the store call (``fetch``'s ``admit``)."""

S = TypeVar("S", KVStore, PiecewiseKVStore)


async def per_key_outcomes(
    call: Callable[[], Awaitable[list[KeyOutcome]]], count: int, *, saving: bool,
    abandoned: Callable[[StoreCallAbandoned], None] = lambda error: None,
) -> list[KeyOutcome]:
    """A store batch call's outcomes; a store error becomes one outcome per key instead.
    ``abandoned`` is told of a call given up on that may still touch its memory."""
    try:
        return await call()
    except StoreError as exc:
        if isinstance(exc, StoreCallAbandoned):
            abandoned(exc)
        return [store_error_outcome(exc, saving=saving)] * count


class _NoHold:
    def release(self) -> None:
        pass


class _SlotHold:
    """A staging slot, given back once: released, or withheld while an abandoned store
    call may still touch it."""

    def __init__(self, pool: StagingPool, slot: Slot) -> None:
        self._pool = pool
        self._slot: Slot | None = slot

    def release(self) -> None:
        if self._slot is not None:
            self._pool.release(self._slot)
            self._slot = None

    def withhold(self, error: StoreCallAbandoned) -> None:
        if self._slot is not None:
            self._pool.withhold(self._slot, until=error.when_returned)
            self._slot = None


class _SlotMemory(Generic[S]):
    """A memory that holds each batch in a staging slot of its own; ``skip_when_full``: a
    save finding no free slot is refused (staging_full) instead of waiting for one."""

    def __init__(self, pool: StagingPool, store: S, *, skip_when_full: bool) -> None:
        self._pool = pool
        self._store: S = store
        self._skip_when_full = skip_when_full

    async def reserve(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], keys: Sequence[str]
    ) -> Values:
        pool = self._pool
        slot = pool.try_take("save") if self._skip_when_full else await pool.take("save")
        if slot is None:
            return _refused(keys, STAGING_FULL)
        return self._values(slot, geometry, block_ids, keys, loading=False)

    async def store(self, values: Values) -> list[KeyOutcome]:
        """Store the values; the slot goes back (or is withheld) whatever happens."""
        try:
            return await self._put(values)
        finally:
            values.release()

    async def fetch(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], keys: Sequence[str],
        *, admit: Callable[[], bool] | None = None,
    ) -> Values:
        """Fetch into a load slot, which goes back only on failure: the values are
        returned readable, and released by whoever reads them. ``admit``: asked once the
        slot is taken, before the store call; False: no call, every key refused."""
        slot = await self._pool.take("load")
        if admit is not None and not admit():
            self._pool.release(slot)
            return _refused(keys, NOT_ADMITTED)
        values = self._values(slot, geometry, block_ids, keys, loading=True)
        try:
            values.outcomes = await self._get(values)
        except BaseException:
            values.release()
            raise
        return values

    def _values(self, slot: Slot, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                keys: Sequence[str], *, loading: bool) -> Values:
        raise NotImplementedError

    async def _put(self, values: Values) -> list[KeyOutcome]:
        """The store call of ``store``, one outcome per value it lent."""
        raise NotImplementedError

    async def _get(self, values: Values) -> list[KeyOutcome]:
        """The store call of ``fetch``, one outcome per key."""
        raise NotImplementedError


class StagingMemory(_SlotMemory[KVStore]):
    """Values in a staging slot, one slot a batch; ``store`` takes only values this
    memory handed out."""

    async def _put(self, values: Values) -> list[KeyOutcome]:
        views = value_views(values.runs)
        return await per_key_outcomes(
            lambda: self._store.put(values.keys, views), len(views), saving=True,
            abandoned=cast(_SlotHold, values.hold).withhold,
        )

    async def _get(self, values: Values) -> list[KeyOutcome]:
        views = value_views(values.runs)
        return await per_key_outcomes(
            lambda: self._store.get_into(values.keys, views), len(views), saving=False,
            abandoned=cast(_SlotHold, values.hold).withhold,
        )

    def _values(self, slot: Slot, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                keys: Sequence[str], *, loading: bool) -> Values:
        """The slot's first rows, one value per key (outcome ``STORED`` once stored)."""
        rows = slot.rows(len(keys), geometry.stored_bytes)
        return Values(list(keys), [Run(0, rows)], [STORED] * len(keys),
                      _SlotHold(self._pool, slot))


class _PiecesHold(_SlotHold):
    """A slot holding a batch's checksums, where the batch's values lie, what works
    them out within the store's call (``Seal``: before a put, after a get), and, for a
    load, what copies the values the store holds in this process (``ReadHere``)."""

    def __init__(self, pool: StagingPool, slot: Slot, pieces: Pieces,
                 checksums: Seal | None, read: ReadHere | None = None) -> None:
        super().__init__(pool, slot)
        self.pieces = pieces
        self.checksums = checksums
        self.read = read


class InPlaceMemory(_SlotMemory[PiecewiseKVStore]):
    """Values left in the engine's blocks: the store puts each one from the block's
    pages and gets it back into the pages of the block it is loaded into, in one call
    per batch. A batch's checksums lie in a staging slot, which also bounds the batches
    in flight as staging does. A saved value's row is its trailer, which the put seals
    in its own call for the values the store lacks; a loaded value's row is the
    trailer that came with it, then the checksum of its pages as they landed, which the
    get measures in its own call (``InPlaceCopyEngine`` compares the two). A store
    holding a batch's values in this process's own memory (Mooncake's segment) hands
    them to ``read_in_place`` instead, which checks and copies each in one pass.

    A store call given up on (``StoreCallAbandoned``) may still touch engine memory.
    A get may still write it, so its batch is answered only once the call has returned
    (a shutdown does not cut that wait short): the engine never reuses blocks the store
    may still write. A put only reads it, and is answered at once (failed), so that a
    hung store holds no engine's blocks for its own timeout: should the engine write a
    block again before the put reads it, the value stored disagrees with the checksum
    sealed before, and no load takes it. Without checksums nothing would tell, so such a
    put is waited for too. The memory stays mapped until every such call has returned
    (``pipeline.app.mapping.RegisteredMapping``).
    """

    def __init__(self, pool: StagingPool, store: PiecewiseKVStore, *, skip_when_full: bool,
                 helpers: HelperThreads | None = None) -> None:
        """``helpers`` share a large batch's checksums and copies with the store's
        thread."""
        super().__init__(pool, store, skip_when_full=skip_when_full)
        self._helpers = helpers

    async def _put(self, values: Values) -> list[KeyOutcome]:
        hold = cast(_PiecesHold, values.hold)
        return await self._call(
            lambda: self._store.put_pieces(values.keys, hold.pieces, seal=hold.checksums),
            hold, saving=True)

    async def _get(self, values: Values) -> list[KeyOutcome]:
        hold = cast(_PiecesHold, values.hold)
        return await self._call(
            lambda: self._store.get_pieces_into(values.keys, hold.pieces,
                                                measure=hold.checksums, read=hold.read),
            hold, saving=False)

    async def _call(self, call: Callable[[], Awaitable[list[KeyOutcome]]], hold: _PiecesHold,
                    *, saving: bool) -> list[KeyOutcome]:
        gone: list[StoreCallAbandoned] = []

        def abandoned(error: StoreCallAbandoned) -> None:
            gone.append(error)
            hold.withhold(error)

        outcomes = await per_key_outcomes(call, len(hold.pieces), saving=saving,
                                          abandoned=abandoned)
        if gone and (not saving or hold.pieces.trailers is None):
            returned = anyio.Event()
            gone[0].when_returned(returned.set)
            with anyio.CancelScope(shield=True):
                await returned.wait()
        return outcomes

    def _values(self, slot: Slot, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                keys: Sequence[str], *, loading: bool) -> Values:
        """Each key's value in engine block ``block_ids[i]``; its row, in the slot's
        first rows, is its trailer (and, loading, the checksum measured on arrival), or
        empty when values carry no checksum."""
        sealed = geometry.checksum_seed is not None
        width = (2 if loading else 1) * CHECKSUM_BYTES if sealed else 0
        rows = slot.rows(len(keys), width)
        pages = page_addresses(geometry, block_ids)
        trailers = checksums = read = None
        if sealed:
            trailers = rows[:, :CHECKSUM_BYTES] if loading else rows
            into = rows[:, CHECKSUM_BYTES:] if loading else rows
            checksums = functools.partial(seal_in_place, geometry, pages, into,
                                          helpers=self._helpers)
        pieces = Pieces(addresses=pages, sizes=geometry.page_sizes, trailers=trailers)
        if loading:
            read = functools.partial(read_in_place, geometry, pages,
                                     rows if sealed else None, helpers=self._helpers)
        return Values(list(keys), [Run(0, rows)], [STORED] * len(keys),
                      _PiecesHold(self._pool, slot, pieces, checksums, read))


class _LeaseHold:
    def __init__(self, store: DirectKVStore, extents: Extents) -> None:
        self._store = store
        self.extents = extents

    def release(self) -> None:
        self._store.release(self.extents)


class _ReservationHold(_LeaseHold):
    def release(self) -> None:
        self._store.commit(self.extents, written=False)


class LentMemory:
    """Values in extents the store lends; ``store`` takes only values this memory
    reserved."""

    def __init__(self, store: DirectKVStore) -> None:
        self._store = store

    async def reserve(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], keys: Sequence[str]
    ) -> Values:
        extents = await self._store.reserve(keys, geometry.stored_bytes,
                                            scope=geometry.scope)
        return Values(list(keys), extents.runs, list(extents.outcomes),
                      _ReservationHold(self._store, extents))

    async def store(self, values: Values) -> list[KeyOutcome]:
        committed = self._store.commit(cast(_ReservationHold, values.hold).extents, written=True)
        lent = held(values.runs, len(committed))
        return [outcome for outcome, has in zip(committed, lent, strict=True) if has]

    async def fetch(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], keys: Sequence[str],
        *, admit: Callable[[], bool] | None = None,
    ) -> Values:
        if admit is not None and not admit():
            return _refused(keys, NOT_ADMITTED)
        try:
            extents = await self._store.lease(keys, geometry.stored_bytes,
                                              scope=geometry.scope)
        except StoreError as exc:
            return _refused(keys, store_error_outcome(exc, saving=False))
        return Values(list(keys), extents.runs, list(extents.outcomes),
                      _LeaseHold(self._store, extents))


def _refused(keys: Sequence[str], outcome: KeyOutcome) -> Values:
    """No memory for any key, each refused with ``outcome``."""
    return Values(list(keys), [], [outcome] * len(keys), _NoHold())
