"""The block-store contract every backend implements (embedded, Mooncake, test fakes).

A value is one stored block: a contiguous byte range inside a staging buffer that was
registered with the store once (zero-copy backends register it for DMA). Every batch
call returns one outcome per key, in order; a backend raises ``StoreError`` only when
the store as a whole is unusable (down, closed), never for a single key.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy
import torch

from pipeline.core.outcomes import PRESENT, BlockStatus, KeyOutcome
from pipeline.core.runs import Run

__all__ = [
    "PRESENCE_OUTCOMES",
    "DirectKVStore",
    "Extents",
    "KVStore",
    "Pieces",
    "PiecewiseKVStore",
    "Presence",
    "ReadHere",
    "Seal",
    "ValueScope",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ValueScope:
    """Whose a value is and what it means, beside its key: the tenant that stored it and
    the fingerprint of the layout that reads it. A store that keeps values past the
    sidecar's life (the disk tier) keeps these with each and loads a value only for the
    scope it was stored in."""

    tenant: str
    fingerprint: str


class Presence(enum.Enum):
    """What the store holds under a key, as one engine would read it."""

    ABSENT = "absent"
    PRESENT = "present"
    """Stored with the expected size: a hit, and not written again."""
    FOREIGN = "foreign_value"
    """Stored, but not as this engine reads it (another size): never a hit, never
    overwritten (the store keeps the first value), so the block is skipped."""
    UNVERIFIED = "unverified_value"
    """Stored without the checksum kept beside it, and ``store.verify`` requires one."""


PRESENCE_OUTCOMES = {
    Presence.PRESENT: PRESENT,
    Presence.FOREIGN: KeyOutcome(BlockStatus.SKIPPED, Presence.FOREIGN.value),
    Presence.UNVERIFIED: KeyOutcome(BlockStatus.SKIPPED, Presence.UNVERIFIED.value),
}
"""What a save of a key the store holds already comes to: present, or skipped when the
value there is not one this engine could read (never overwritten)."""


@runtime_checkable
class KVStore(Protocol):
    """A byte store keyed by strings; all methods are safe to call from the event loop."""

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register a staging buffer (1-D uint8, contiguous) that values will live in."""

    async def exists(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Presence]:
        """Whether each key is stored and readable as a value of its size in ``sizes``."""

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        """Store each value (a 1-D uint8 slice of a registered buffer) under its key.

        Outcomes: ``STORED``, ``PRESENT`` (the key existed: not overwritten; skipped as
        ``foreign_value`` where it holds a value of another size), ``STORE_FULL``
        (skipped: no room), or ``failed(reason)``.
        """

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        """Copy each key's value into its buffer (a 1-D uint8 slice of a registered buffer).

        Outcomes: ``LOADED``, ``MISSING``, or ``failed(reason)`` (a size mismatch is a
        failure). A buffer whose outcome is not ``LOADED`` holds undefined bytes.
        """

    async def remove(self, keys: Sequence[str]) -> int:
        """Remove keys if present, even while being read (only values found corrupt are
        removed); return how many were removed."""

    async def aclose(self) -> None:
        """Release the backend's resources; idempotent."""


@dataclasses.dataclass(eq=False, slots=True)
class Extents:
    """Store memory lent for one batch: the values lent, as runs (``Run``), and per key
    the outcome (a key lent none says why). ``handle`` is the backend's own bookkeeping."""

    runs: list[Run]
    outcomes: list[KeyOutcome]
    handle: list[Any]


@runtime_checkable
class DirectKVStore(Protocol):
    """A store whose values live in this process: stages copy straight into and out of
    its memory, one copy instead of two through staging. Values lent side by side are
    ``value_span(size)`` bytes apart (each on a cache line), or packed."""

    async def reserve(self, keys: Sequence[str], size: int, *,
                      scope: ValueScope | None = None) -> Extents:
        """Writable, not yet readable extents of ``size`` bytes for new keys (outcome
        ``STORED`` once committed); present keys and a full store say so instead.
        ``scope``: whose the values are (None: nobody's in particular)."""

    def commit(self, extents: Extents, *, written: bool) -> list[KeyOutcome]:
        """Make reserved extents readable (``written``) or give them back."""

    async def lease(self, keys: Sequence[str], size: int, *,
                    scope: ValueScope | None = None) -> Extents:
        """Pinned, readable extents of stored values (outcome ``LOADED``); a value kept
        with another ``scope`` than the one asked for is not lent."""

    def release(self, extents: Extents) -> None:
        """End a lease; the store may evict those values again."""



@dataclasses.dataclass(frozen=True, slots=True)
class Pieces:
    """A batch of values as byte ranges of memory registered with the store. Value i is
    ``sizes[j]`` bytes at ``addresses[i, j]`` for every j in order (engine pages, read or
    written in place), then row i of ``trailers``, the sidecar's own bytes (its checksum)."""

    addresses: numpy.ndarray
    """int64 ``[values, pages]``."""
    sizes: tuple[int, ...]
    trailers: torch.Tensor | None
    """uint8 ``[values, bytes]``, a row each, in a buffer registered with the store (rows
    may lie further apart than their bytes); None: values have none."""

    def __len__(self) -> int:
        return int(self.addresses.shape[0])


Seal = Callable[[Sequence[int]], None]
"""Works on the values at these positions of a batch where they lie, within a store's
call: seals their trailers (checksums) before a put, or measures them after a get."""
ReadHere = Callable[[Sequence[int], Sequence[int]], None]
"""``read(positions, sources)``, within a store's get: the values at these positions of
a batch lie whole (their bytes back to back) at these addresses in this process's own
memory; copies each into its pieces, and leaves them as the get and its ``measure``
would have."""


@runtime_checkable
class PiecewiseKVStore(Protocol):
    """A store that moves each value as several byte ranges (scatter-gather), so values
    go straight from engine memory into the store and back, with no copy in between.
    Engine memory is registered while a session maps it."""

    def register_memory(self, memory: torch.Tensor) -> None:
        """Register engine memory (1-D uint8, contiguous) that pages will lie in."""

    def unregister_memory(self, memory: torch.Tensor) -> None:
        """Forget memory registered with ``register_memory``, before it is unmapped."""

    def when_calls_returned(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) once no call given up on is left that
        may still touch registered memory; at once if there is none."""

    async def put_pieces(
        self, keys: Sequence[str], values: Pieces, *, seal: Seal | None = None
    ) -> list[KeyOutcome]:
        """As ``KVStore.put``, each value the concatenation of its pieces. ``seal`` is
        called within the call, once the store has said which keys it lacks, with the
        positions of the values about to be sent: a value already stored is never read,
        and no hop of its own is spent on it."""

    async def get_pieces_into(
        self, keys: Sequence[str], buffers: Pieces, *, measure: Seal | None = None,
        read: ReadHere | None = None,
    ) -> list[KeyOutcome]:
        """As ``KVStore.get_into``, each value spread over its pieces in order.
        ``measure`` is called within the call with the positions of the values got whole
        (to checksum them where they landed, with no hop of its own). A store that holds
        values in this process's own memory may hand them to ``read`` instead of moving
        them itself (then ``measure`` is not called for them)."""
