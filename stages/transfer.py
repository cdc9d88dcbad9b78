"""Transfer (save side): engine blocks into values, in the batch memory.

Requests under store pressure skip without copying; a save waits while loads are in
flight (for at most ``yield_to_loads_ms``), so loads get the cores first. No copy of a
request starts once it is stopped or past its deadline (``JobTracker.enter``); a copy
started is finished, and its values are dropped if its request was stopped meanwhile.
After the copy each block is checked where it lies (``CopyEngine.unchanged``): a block
the engine wrote during the copy (breaking the fence) may be torn, and the batch is
dropped (``CHANGED``), never stored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pipeline.core.outcomes import CHANGED, DISCARDED, MEMORY_LOST, STORE_FULL, BlockStatus
from pipeline.core.seams import BatchMemory, CopyEngine, Count, Values, count_nothing
from pipeline.state.jobs import BlockTask, JobTracker, StagedBatch, StorePressure, live

__all__ = ["TransferStage"]


class TransferStage:
    def __init__(
        self,
        memory: BatchMemory,
        copy: CopyEngine,
        tracker: JobTracker,
        pressure: StorePressure,
        *,
        yield_to_loads_s: float = 0.0,
        copied: Count = count_nothing,
        after_copy: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``copied`` hears the bytes of each batch copied out of the engine.
        ``after_copy``: awaited between a batch's copy and its check (fault point
        ``transfer.copied``)."""
        self._memory = memory
        self._copy = copy
        self._tracker = tracker
        self._pressure = pressure
        self._yield_s = yield_to_loads_s
        self._copied = copied
        self._after_copy = after_copy

    async def process(self, tasks: list[BlockTask]) -> StagedBatch | None:
        tasks = live(tasks)
        skipped, tasks = self._pressure.split(tasks)
        if skipped:
            await self._tracker.settle_all(skipped, STORE_FULL)
        if not tasks:
            return None
        await self._tracker.yield_to_loads(self._yield_s)
        reserved = await self._reserve(tasks)
        if reserved is None:
            return None
        tasks, values = reserved
        try:
            return await self._copy_out(tasks, values)
        finally:
            await self._tracker.finish_stopped(tasks)

    async def _reserve(self, tasks: list[BlockTask]) -> tuple[list[BlockTask], Values] | None:
        """Reserve the values of the tasks a copy may take, then admit them to it
        (``JobTracker.enter``): a job stopped, or past its deadline, while the reservation
        waited is left out, and the rest reserved again. No job counts as copying while
        it waits here: a cancel is answered at once."""
        tracker = self._tracker
        while True:
            tasks, out, outcomes = tracker.screen(tasks)
            if out:
                await tracker.settle_each(out, outcomes)
            if not tasks:
                return None
            values = await self._memory.reserve(
                tasks[0].geometry, [task.block_id for task in tasks], [task.key for task in tasks])
            passed, out, _ = tracker.enter(tasks)
            if not out and len(passed) == len(tasks):
                return tasks, values
            values.release()
            tracker.leave(passed)

    async def _copy_out(self, tasks: list[BlockTask], values: Values) -> StagedBatch | None:
        """Copy the admitted tasks' blocks into their values: the batch to commit."""
        tracker = self._tracker
        try:
            batch, refused, outcomes = StagedBatch.split(tasks, values, BlockStatus.STORED)
            if refused:
                self._pressure.record(refused, outcomes)
                await tracker.settle_each(refused, outcomes)
            if batch is None:
                return None
            try:
                await self._copy.gather(batch.geometry, batch.block_ids, batch.runs)
                if self._after_copy is not None:
                    await self._after_copy()
                unchanged = await self._copy.unchanged(batch.geometry, batch.block_ids,
                                                       batch.runs)
            except BaseException:
                values.release()
                raise
        finally:
            tracker.leave(tasks)
        if batch.session.memory_lost():
            values.release()
            await tracker.settle_all(batch.tasks, MEMORY_LOST)
            return None
        if batch.abandoned():  # a job stopped during the copy: its blocks may be reused
            values.release()
            await tracker.discard(batch.tasks)
            return None
        if not all(unchanged):
            values.release()
            await tracker.settle_each(batch.tasks, [
                DISCARDED if same else CHANGED for same in unchanged])
            return None
        self._copied(len(batch.tasks) * batch.geometry.stored_bytes)
        return batch
