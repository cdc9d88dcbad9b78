"""Request lifetimes through the real stages: a request stopped (cancelled, past its
deadline, abandoned) never has a copy started, a copy started is finished, nothing a
stopped save copied is stored, and no answer comes while a copy may still change it."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import msgspec
import pytest
import torch

import tests.unit.stages.test_stages as kit
from pipeline.backends.cpu_copy import CpuCopyEngine
from pipeline.core.config import BatchingStageConfig
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.messages import Load, Save
from pipeline.core.outcomes import CANCELLED, CHANGED, DISCARDED, STORED, BlockStatus
from pipeline.core.runs import Run
from pipeline.core.store import Presence
from pipeline.state.jobs import BlockTask, Job, StagedBatch, StorePressure, TaskBatch
from stages.batching import BatchingStage
from stages.commit import CommitStage
from stages.dedup import DedupStage
from stages.fetch import FetchStage
from stages.group_filter import GroupFilterStage
from stages.hashing import HashingStage
from stages.scatter import ScatterStage
from stages.transfer import TransferStage

SAVE = kit.save(kit.tokens(8), [1, 2], [9], [0, 3])
"""Two attention blocks and one mamba block of the hybrid layout (block size 4)."""


@pytest.fixture
def hybrid() -> kit.Harness:
    return kit.harness(kit.HYBRID)


class HeldCopy:
    """The real copy engine, each copy held at its start until released: a copy in
    flight, for as long as a test needs."""

    def __init__(self, inner: CpuCopyEngine) -> None:
        self._inner = inner
        self.started = anyio.Event()
        self.release = anyio.Event()

    def waits(self, nbytes: int) -> bool:
        return True

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     runs: list[Run]) -> None:
        self.started.set()
        await self.release.wait()
        await self._inner.gather(geometry, block_ids, runs)

    async def unchanged(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                        runs: list[Run]) -> list[bool]:
        return await self._inner.unchanged(geometry, block_ids, runs)

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      runs: list[Run]) -> list[bool]:
        self.started.set()
        await self.release.wait()
        return await self._inner.scatter(geometry, block_ids, runs)


async def named(h: kit.Harness, message: Save | Load) -> tuple[Job, list[BlockTask]]:
    """An accepted job through the group filter and hashing: its named blocks."""
    job = h.job(message)
    await GroupFilterStage(h.tracker).process(job)
    tasks = await HashingStage(h.tracker, h.limiter).process(job)
    assert tasks
    return job, tasks


def reasons(job: Job) -> set[tuple[BlockStatus, str]]:
    return {(report.status, report.reason) for report in job.reports}


async def stored_keys(h: kit.Harness, tasks: Sequence[BlockTask]) -> list[str]:
    """The keys of ``tasks`` the store holds a value of any size for."""
    presence = await h.store.exists([task.key for task in tasks], [1] * len(tasks))
    return [task.key for task, there in zip(tasks, presence, strict=True)
            if there is not Presence.ABSENT]


async def test_a_save_cancelled_while_queued_is_answered_at_once_and_never_copied(
    hybrid: kit.Harness,
) -> None:
    """Stopped before its copy: answered there and then, every block skipped as
    cancelled; the batch reaching the transfer afterwards is dropped uncopied."""
    job, tasks = await named(hybrid, SAVE)
    await hybrid.tracker.stop(job, CANCELLED)
    assert hybrid.finished() == [job]
    assert reasons(job) == {(BlockStatus.SKIPPED, CANCELLED)}
    transfer = TransferStage(hybrid.memory, hybrid.copy, hybrid.tracker, StorePressure())
    for batch in kit.by_group(tasks):
        assert await transfer.process(batch) is None
    assert await stored_keys(hybrid, tasks) == []
    assert hybrid.pool.free_slots("save") == 6 and hybrid.tracker.copies_in_flight == 0


async def test_a_cancel_during_a_copy_is_answered_once_it_returns_and_nothing_is_stored(
    hybrid: kit.Harness,
) -> None:
    """A copy in flight is finished, not interrupted; the job is answered only after
    it returns, and what it copied is dropped, never committed."""
    job, tasks = await named(hybrid, SAVE)
    held = HeldCopy(hybrid.copy)
    transfer = TransferStage(hybrid.memory, held, hybrid.tracker, StorePressure())
    first, *rest = kit.by_group(tasks)
    staged: list[StagedBatch | None] = []
    async with anyio.create_task_group() as group:
        async def copy() -> None:
            staged.append(await transfer.process(first))

        group.start_soon(copy)
        await held.started.wait()
        await hybrid.tracker.stop(job, CANCELLED)
        assert hybrid.finished() == [] and not job.done, "answered while its copy runs"
        held.release.set()
    assert staged == [None]
    assert hybrid.finished() == [job]
    assert reasons(job) == {(BlockStatus.SKIPPED, CANCELLED)}
    for batch in rest:  # the job's other batch, still on its way, never copies
        assert await transfer.process(batch) is None
    assert await stored_keys(hybrid, tasks) == []
    assert hybrid.pool.free_slots("save") == 6 and hybrid.tracker.copies_in_flight == 0


async def test_a_cancel_after_the_copy_and_before_the_commit_stores_nothing(
    hybrid: kit.Harness,
) -> None:
    """Copied, not committed: the cancel is answered at once (no copy in flight), and
    the commit drops the batch and gives its slot back."""
    job, staged = await kit.staged_save(hybrid)
    await hybrid.tracker.stop(job, CANCELLED)
    assert hybrid.finished() == [job]
    commit = CommitStage(hybrid.memory, hybrid.store, hybrid.tracker, StorePressure(),
                         kit.NO_EVENTS)
    await commit.process(staged)
    assert await stored_keys(hybrid, staged.tasks) == []
    assert hybrid.pool.free_slots("save") == 6
    assert reasons(job) <= {(BlockStatus.SKIPPED, CANCELLED), (BlockStatus.SKIPPED,
                                                                "incomplete_block")}


async def test_a_cancel_after_the_commit_changes_nothing(hybrid: kit.Harness) -> None:
    """A save answered stored stays stored: a late cancel finds nothing to stop."""
    job = await kit.run_save(hybrid, SAVE)
    assert job.done
    stored = [task for task in job.planned if task.outcome == STORED]
    assert stored
    await hybrid.tracker.stop(job, CANCELLED)
    assert (BlockStatus.SKIPPED, CANCELLED) not in reasons(job)
    assert await stored_keys(hybrid, stored) == [task.key for task in stored]


async def test_no_copy_of_a_save_or_load_starts_past_its_deadline(hybrid: kit.Harness) -> None:
    """Past its deadline a save copies nothing and stores nothing, and a load writes no
    engine block: each block is reported as missed by the deadline, and counted."""
    saved = await kit.run_save(hybrid, SAVE)
    assert (BlockStatus.STORED, "") in reasons(saved)
    past = time.monotonic() - 0.001
    late_save, tasks = await named(hybrid, msgspec.structs.replace(
        kit.save(kit.tokens(8, start=500), [4, 5], [9], [0, 6]), deadline=past))
    transfer = TransferStage(hybrid.memory, hybrid.copy, hybrid.tracker, StorePressure())
    for batch in kit.by_group(tasks):
        assert await transfer.process(batch) is None
    assert late_save.done and reasons(late_save) <= {
        (BlockStatus.SKIPPED, "deadline"), (BlockStatus.SKIPPED, "incomplete_block")}
    assert await stored_keys(hybrid, tasks) == []

    before = hybrid.snapshot()
    late_load, tasks = await named(hybrid, msgspec.structs.replace(
        kit.load(kit.tokens(8), 8, [10, 11], [12], [0, 13]), deadline=past))
    fetch = FetchStage(hybrid.memory, hybrid.tracker)
    scatter = ScatterStage(hybrid.store, hybrid.copy, hybrid.tracker, kit.NO_EVENTS)
    for batch in kit.by_group(tasks):
        staged = await fetch.process(batch)
        if staged is not None:
            await scatter.process(staged)
    assert late_load.done and reasons(late_load) == {(BlockStatus.FAILED, "deadline")}
    after = hybrid.snapshot()
    assert all(torch.equal(before[layer], after[layer]) for layer in before)
    assert hybrid.tracker.deadlines_missed == 2
    assert hybrid.pool.free_slots("load") == 2


async def test_a_load_stopped_during_its_scatter_reports_the_blocks_it_wrote(
    hybrid: kit.Harness,
) -> None:
    """A scatter in flight is finished: its blocks are reported loaded (they hold the
    stored bytes), and the job is answered only once it returned."""
    await kit.run_save(hybrid, SAVE)
    before = hybrid.snapshot()
    job, tasks = await named(hybrid, kit.load(kit.tokens(8), 8, [10, 11], [12], [0, 13]))
    held = HeldCopy(hybrid.copy)
    fetch = FetchStage(hybrid.memory, hybrid.tracker)
    scatter = ScatterStage(hybrid.store, held, hybrid.tracker, kit.NO_EVENTS)
    first, *rest = kit.by_group(tasks)
    staged = await fetch.process(first)
    assert staged is not None
    async with anyio.create_task_group() as group:
        group.start_soon(scatter.process, staged)
        await held.started.wait()
        await hybrid.tracker.stop(job, CANCELLED)
        assert not job.done, "answered while its scatter runs"
        held.release.set()
    assert job.done and job in hybrid.finished()
    loaded = {task.block_id for task in first}
    assert {r.block_id for r in job.reports if r.status is BlockStatus.LOADED} == loaded
    assert {r.reason for r in job.reports if r.block_id not in loaded} == {CANCELLED}
    for task in first:
        for layer in hybrid.session.layout.groups[task.geometry.kv_group_id].layers:
            assert torch.equal(hybrid.block(layer, task.block_id),
                               hybrid.block(layer, {10: 1, 11: 2}[task.block_id]))
    for batch in rest:  # the job's other batch, on its way: never written
        if (later := await fetch.process(batch)) is not None:
            await scatter.process(later)
        for task in batch:
            for layer in hybrid.session.layout.groups[task.geometry.kv_group_id].layers:
                block_dim = hybrid.tensors[layer][1]
                was = before[layer].select(block_dim, task.block_id)
                assert torch.equal(hybrid.block(layer, task.block_id), was)


async def test_abandoning_a_job_with_a_copy_in_flight_waits_for_the_copy(
    hybrid: kit.Harness,
) -> None:
    """``abandon`` (a failed start, a shutdown) answers no job whose copy is in flight:
    it stops it, and the job is answered when the copy returns."""
    job, tasks = await named(hybrid, SAVE)
    held = HeldCopy(hybrid.copy)
    transfer = TransferStage(hybrid.memory, held, hybrid.tracker, StorePressure())
    first, *_ = kit.by_group(tasks)
    async with anyio.create_task_group() as group:
        group.start_soon(transfer.process, first)
        await held.started.wait()
        assert hybrid.tracker.abandon_open("shutdown") == []
        assert not job.done
        held.release.set()
    assert job.done and hybrid.finished() == [job]
    assert (BlockStatus.FAILED, "shutdown") in reasons(job)
    assert await stored_keys(hybrid, tasks) == []


async def test_a_block_the_engine_writes_during_its_copy_is_never_stored(
    hybrid: kit.Harness,
) -> None:
    """The fence broken: the engine writes a block between its copy and the check (the
    copy held there), so what was copied may be torn. The batch is dropped: the block
    is reported changed, its neighbour discarded, and nothing is stored."""
    _, tasks = await named(hybrid, SAVE)
    first, *_ = kit.by_group(tasks)
    written = first[0]
    layer = hybrid.session.layout.groups[written.geometry.kv_group_id].layers[0]

    async def write_meanwhile() -> None:
        hybrid.block(layer, written.block_id).add_(1.0)

    transfer = TransferStage(hybrid.memory, hybrid.copy, hybrid.tracker, StorePressure(),
                             after_copy=write_meanwhile)
    assert await transfer.process(first) is None
    outcomes = {(task.block_id, task.outcome) for task in first}
    assert (written.block_id, CHANGED) in outcomes
    assert {outcome for block, outcome in outcomes if block != written.block_id} <= {DISCARDED}
    assert await stored_keys(hybrid, first) == []
    assert hybrid.pool.free_slots("save") == 6

    unwritten = TransferStage(hybrid.memory, hybrid.copy, hybrid.tracker, StorePressure())
    _, tasks = await named(hybrid, kit.save(kit.tokens(8, start=300), [1, 2], [9], [0, 3]))
    batch = kit.by_group(tasks)[0]
    staged = await unwritten.process(batch)
    assert staged is not None and len(staged.tasks) == len(batch)
    staged.values.release()


async def test_a_save_waiting_for_a_staging_slot_is_cancelled_at_once(
    hybrid: kit.Harness,
) -> None:
    """A save waiting for a staging slot has touched nothing: a cancel is answered there
    and then, not once a slot frees; when one does, the save copies nothing."""
    job, tasks = await named(hybrid, SAVE)
    taken = [await hybrid.pool.take("save") for _ in range(hybrid.pool.free_slots("save"))]
    transfer = TransferStage(hybrid.memory, hybrid.copy, hybrid.tracker, StorePressure())
    first, *_ = kit.by_group(tasks)
    staged: list[StagedBatch | None] = []
    async with anyio.create_task_group() as group:
        async def copy() -> None:
            staged.append(await transfer.process(first))

        group.start_soon(copy)
        await anyio.wait_all_tasks_blocked()
        await hybrid.tracker.stop(job, CANCELLED)
        assert job.done and hybrid.finished() == [job], "the cancel waited for a slot"
        for slot in taken:
            hybrid.pool.release(slot)
    assert staged == [None]
    assert await stored_keys(hybrid, tasks) == []
    assert hybrid.pool.free_slots("save") == 6 and hybrid.tracker.copies_in_flight == 0


async def test_blocks_of_an_answered_job_of_a_closed_session_pass_every_stage_unread(
    hybrid: kit.Harness,
) -> None:
    """A session closed (its engine reaped) once its stopped jobs are answered lets go of
    its memory and geometry: the jobs' blocks still on their way are dropped by each
    stage unread, never failing it (a batcher that fails ends the sidecar)."""
    save_job, save_tasks = await named(hybrid, SAVE)
    await kit.run_save(hybrid, kit.save(kit.tokens(8, start=700), [4, 5], [9], [0, 6]))
    load_job, load_tasks = await named(hybrid, kit.load(kit.tokens(8, start=700), 8,
                                                        [10, 11], [12], [0, 13]))
    for job in (save_job, load_job):
        await hybrid.tracker.stop(job, "session_closed")
    for job in hybrid.finished():  # answered (the completion stage's part)
        hybrid.tracker.answered(job)
    hybrid.session.close()
    assert hybrid.session.store_groups == ()
    batching = BatchingStage(BatchingStageConfig(), 4096)
    assert all(batching.limit_of(task) >= 1 for task in save_tasks + load_tasks)
    assert await DedupStage(hybrid.store, hybrid.tracker).process(
        TaskBatch(save_tasks)) is None
    transfer = TransferStage(hybrid.memory, hybrid.copy, hybrid.tracker, StorePressure())
    assert await transfer.process(save_tasks) is None
    assert await FetchStage(hybrid.memory, hybrid.tracker).process(load_tasks) is None
    assert hybrid.pool.free_slots("save") == 6 and hybrid.pool.free_slots("load") == 2
