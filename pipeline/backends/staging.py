"""The fixed staging pool: all bytes in flight between engines and the store live here.

The pool is one preallocated buffer cut into equal slots; a batch of blocks occupies one
slot. Free slots travel through a bounded stream, so an exhausted pool simply makes the
next ``acquire`` wait: that wait is the backpressure that reaches engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import anyio
import structlog
import torch

__all__ = ["Slot", "StagingPool"]

log = structlog.get_logger("kvsidecar.staging")


class StagingPool:
    def __init__(self, pool_bytes: int, slot_bytes: int, *, load_slots: int = 1) -> None:
        slots = pool_bytes // slot_bytes
        if slots < 2:
            raise ValueError(
                f"staging pool of {pool_bytes} bytes holds {slots} slot(s) of {slot_bytes} "
                "bytes; at least 2 are needed (one for loads, one for saves)"
            )
        if not 1 <= load_slots < slots:
            raise ValueError(f"load_slots must be in [1, {slots - 1}], got {load_slots}")
        self.slot_bytes = slot_bytes
        self.buffer = torch.empty(slots * slot_bytes, dtype=torch.uint8)
        # Loads sit on the engine's critical path: they get slots saves can never take.
        self._free = {
            "load": anyio.create_memory_object_stream[Slot](max_buffer_size=load_slots),
            "save": anyio.create_memory_object_stream[Slot](max_buffer_size=slots - load_slots),
        }
        for index in range(slots):
            kind = "load" if index < load_slots else "save"
            view = self.buffer[index * slot_bytes : (index + 1) * slot_bytes]
            self._free[kind][0].send_nowait(Slot(index, kind, view))
        self.slots = slots
        self.load_slots = load_slots
        self.withheld = 0

    def touch(self) -> None:
        """Write every page of the pool now, for a pool that values go through: a page's
        first write costs a fault, several times the copy itself, and would be paid by
        whichever copy first lands there (the first rounds through every slot)."""
        self.buffer.zero_()

    def free_slots(self, kind: str) -> int:
        return self._free[kind][1].statistics().current_buffer_used

    async def take(self, kind: str) -> Slot:
        """A free slot of ``kind`` ("load" or "save"), waiting for one if none is free.
        With one free there is no trip through the event loop (anyio's ``receive``
        always makes one): the stage taking it yields once per item already."""
        slot = self.try_take(kind)
        return slot if slot is not None else await self._free[kind][1].receive()

    def try_take(self, kind: str) -> Slot | None:
        """A free slot without waiting, or None (for skip-on-overflow policies)."""
        try:
            return self._free[kind][1].receive_nowait()
        except anyio.WouldBlock:
            return None

    def release(self, slot: Slot) -> None:
        self._free[slot.kind][0].send_nowait(slot)

    def withhold(self, slot: Slot, until: Callable[[Callable[[], None]], None]) -> None:
        """Keep a slot out of use while an abandoned store call may still touch it; it
        comes back when ``until`` calls back (``StoreCallAbandoned.when_returned``)."""
        self.withheld += 1
        log.warning("staging.slot.withheld", slot=slot.index, kind=slot.kind,
                    withheld=self.withheld, slots=self.slots)

        def give_back() -> None:
            self.withheld -= 1
            self.release(slot)
            log.info("staging.slot.returned", slot=slot.index, kind=slot.kind,
                     withheld=self.withheld)

        until(give_back)


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    index: int
    kind: str
    view: torch.Tensor
    """The slot's bytes: 1-D uint8, contiguous, inside the pool's registered buffer."""

    def rows(self, count: int, row_bytes: int) -> torch.Tensor:
        """The first ``count * row_bytes`` bytes as a [count, row_bytes] matrix."""
        return self.view[: count * row_bytes].view(count, row_bytes)
