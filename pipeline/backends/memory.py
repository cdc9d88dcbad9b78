"""The batch memories: where a batch's values live between the copy and the store.

``StagingMemory`` holds them in a staging slot and moves them with the store's batch
calls (Mooncake: zero-copy from the registered pool). ``LentMemory`` writes and reads
them in the store's own memory (the embedded store), sparing one copy each way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import cast

import torch

from pipeline.backends.staging import Slot, StagingPool
from pipeline.core.errors import StoreCallAbandoned, StoreError
from pipeline.core.outcomes import STORED, BlockStatus, KeyOutcome, store_error_outcome
from pipeline.core.seams import Values
from pipeline.core.store import DirectKVStore, Extents, KVStore

__all__ = ["STAGING_FULL", "LentMemory", "StagingMemory", "per_key_outcomes"]

STAGING_FULL = KeyOutcome(BlockStatus.SKIPPED, "staging_full")


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


class StagingMemory:
    """Values in a staging slot, one slot a batch; ``store`` takes only values this
    memory handed out."""

    def __init__(self, pool: StagingPool, store: KVStore, *, skip_when_full: bool) -> None:
        """``skip_when_full``: a save finding no free slot is refused (staging_full)
        instead of waiting for one."""
        self._pool = pool
        self._store = store
        self._skip_when_full = skip_when_full

    async def reserve(self, keys: Sequence[str], size: int) -> Values:
        pool = self._pool
        slot = pool.try_take("save") if self._skip_when_full else await pool.take("save")
        if slot is None:
            return _refused(keys, STAGING_FULL)
        return self._values(slot, keys, size)

    async def store(self, values: Values) -> list[KeyOutcome]:
        hold = cast(_SlotHold, values.hold)
        views = _held(values)
        try:
            return await per_key_outcomes(
                lambda: self._store.put(values.keys, views), len(views), saving=True,
                abandoned=hold.withhold,
            )
        finally:
            hold.release()

    async def fetch(self, keys: Sequence[str], size: int) -> Values:
        values = self._values(await self._pool.take("load"), keys, size)
        hold = cast(_SlotHold, values.hold)
        views = _held(values)
        try:
            values.outcomes = await per_key_outcomes(
                lambda: self._store.get_into(values.keys, views), len(views), saving=False,
                abandoned=hold.withhold,
            )
        except BaseException:
            hold.release()
            raise
        return values

    def _values(self, slot: Slot, keys: Sequence[str], size: int) -> Values:
        """The slot's first rows, one value per key (outcome ``STORED`` once stored)."""
        views: list[torch.Tensor | None] = list(slot.rows(len(keys), size).unbind(0))
        return Values(list(keys), views, [STORED] * len(keys), _SlotHold(self._pool, slot))


def _held(values: Values) -> list[torch.Tensor]:
    return [view for view in values.views if view is not None]


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

    async def reserve(self, keys: Sequence[str], size: int) -> Values:
        extents = await self._store.reserve(keys, size)
        return Values(list(keys), extents.views, list(extents.outcomes),
                      _ReservationHold(self._store, extents))

    async def store(self, values: Values) -> list[KeyOutcome]:
        committed = self._store.commit(cast(_ReservationHold, values.hold).extents, written=True)
        return [outcome for outcome, view in zip(committed, values.views, strict=True)
                if view is not None]

    async def fetch(self, keys: Sequence[str], size: int) -> Values:
        try:
            extents = await self._store.lease(keys, size)
        except StoreError as exc:
            return _refused(keys, store_error_outcome(exc, saving=False))
        return Values(list(keys), extents.views, list(extents.outcomes),
                      _LeaseHold(self._store, extents))


def _refused(keys: Sequence[str], outcome: KeyOutcome) -> Values:
    """No memory for any key, each refused with ``outcome``."""
    return Values(list(keys), [None] * len(keys), [outcome] * len(keys), _NoHold())
