"""The two seams the data stages move bytes through, each chosen once at the root.

- ``BatchMemory``: where a batch's values live. The staging pool (values reach the store
  by its batch calls), memory the store lends (the embedded store: one copy each way),
  or the engine's blocks themselves (a store that moves values in pieces: no copy).
- ``CopyEngine``: gathers engine blocks into values and scatters them back, sealing and
  verifying checksums. CPU threads today; a CUDA engine next.

A stage calls these and never asks which backend it has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.outcomes import KeyOutcome
from pipeline.core.runs import Run

__all__ = ["BatchMemory", "CopyEngine", "Count", "Hold", "Values", "count_nothing"]

Count = Callable[[int], None]
"""Hears a number of bytes (moved, say)."""


def count_nothing(count: int) -> None:
    pass


class Hold(Protocol):
    """A memory's hold on one batch's values."""

    def release(self) -> None:
        """Give the memory back without storing the values; idempotent."""


@dataclasses.dataclass(eq=False, slots=True)
class Values:
    """One batch's values: where they lie, as runs (``Run``), and per key the outcome (a
    key with no value says why); and the hold that gives their memory back."""

    keys: list[str]
    runs: list[Run]
    outcomes: list[KeyOutcome]
    hold: Hold

    def release(self) -> None:
        self.hold.release()


class BatchMemory(Protocol):
    async def reserve(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], keys: Sequence[str]
    ) -> Values:
        """Save: room for the value of each key, from engine block ``block_ids[i]``
        (``geometry.stored_bytes``, outcome ``STORED`` once stored); keys refused say
        why (present, store full, staging full)."""

    async def store(self, values: Values) -> list[KeyOutcome]:
        """Save: store the written values (those it lent, in order) and give their
        memory back. A store error is an outcome per key, never raised."""

    async def fetch(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], keys: Sequence[str],
        *, admit: Callable[[], bool] | None = None,
    ) -> Values:
        """Load: each key's stored value, readable (outcome ``LOADED``), or why there is
        none, on its way to engine block ``block_ids[i]``. A store error is an outcome
        per key, never raised. ``admit``: asked after any wait, before the store call
        (which, for values moved in place, writes the engine's blocks); False: no call,
        every key refused."""


class CopyEngine(Protocol):
    """Paired at the root with the batch memory whose values it fills and empties."""

    def waits(self, nbytes: int) -> bool:
        """Whether a batch of ``nbytes`` is copied elsewhere (other threads, a device's
        streams) while the event loop waits, rather than on the event loop itself."""

    async def gather(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], runs: Sequence[Run],
    ) -> None:
        """Fill value i (of ``runs``, one per block) from engine block ``block_ids[i]``,
        then seal its checksum."""

    async def unchanged(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], runs: Sequence[Run],
    ) -> list[bool]:
        """After ``gather``: whether each engine block still holds what its value was
        copied from (False: the engine wrote it during the copy, breaking the fence; the
        value may be torn). Engines that cannot tell answer True."""

    async def scatter(
        self, geometry: StoreGroupGeometry, block_ids: Sequence[int], runs: Sequence[Run],
    ) -> list[bool]:
        """Check each value against its checksum, then copy only the intact ones into
        their engine blocks: the engine never receives a corrupted byte. Returns whether
        each value was intact. (Values a store moved in place reached the engine's blocks
        before the check: one that fails is reported failed, and the engine recomputes
        its block before reading it.)"""
