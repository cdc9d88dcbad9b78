"""The staging pool: disjoint slots of one buffer, backpressure, slots reserved for loads."""

from __future__ import annotations

import mmap
import resource

import anyio
import pytest
import torch

from pipeline.backends.staging import Slot, StagingPool

TIMEOUT_S = 5


def test_slots_are_disjoint_views_of_one_buffer() -> None:
    """Every slot views its own slot_bytes of the pool buffer; writing one leaves others alone."""
    pool = StagingPool(4 * 64, 64, load_slots=1)
    slots = [pool.try_take("load")] + [pool.try_take("save") for _ in range(3)]
    assert all(slot is not None for slot in slots)
    base = pool.buffer.data_ptr()
    extents = []
    for slot in slots:
        assert slot is not None
        assert slot.view.dtype == torch.uint8 and slot.view.dim() == 1
        assert slot.view.is_contiguous() and slot.view.numel() == 64
        start = slot.view.data_ptr() - base
        assert 0 <= start and start + 64 <= pool.buffer.numel()
        extents.append(start)
    assert sorted(extents) == [0, 64, 128, 192]
    for value, slot in enumerate(slots, start=1):
        assert slot is not None
        slot.view.fill_(value)
    for value, slot in enumerate(slots, start=1):
        assert slot is not None
        assert bool((slot.view == value).all())
    assert sorted(pool.buffer.tolist()) == sorted([1] * 64 + [2] * 64 + [3] * 64 + [4] * 64)


def _faults_writing(buffer: torch.Tensor) -> int:
    """Page faults this process takes writing every byte of ``buffer`` once."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer.fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_touched_pool_is_written_without_page_faults() -> None:
    """touch() takes the pool's first-write faults at once: a copy writing into it
    afterwards takes none, where one into fresh memory takes one per page. (The fresh
    memory is mapped here: a pool's buffer may reuse pages the allocator already holds,
    which a test run before this one has written.)"""
    touched = StagingPool(64 << 20, 16 << 20)
    touched.touch()
    assert bool((touched.buffer == 0).all())
    with mmap.mmap(-1, touched.buffer.numel()) as fresh:
        faults_fresh = _faults_writing(torch.frombuffer(fresh, dtype=torch.uint8))
    faults_touched = _faults_writing(touched.buffer)
    assert faults_fresh > 0
    assert faults_touched * 10 < faults_fresh


def test_rows_are_a_matrix_over_the_slot_start() -> None:
    """rows(count, row_bytes) views the first count * row_bytes bytes of the slot."""
    pool = StagingPool(2 * 64, 64)
    slot = pool.try_take("save")
    assert slot is not None
    rows = slot.rows(3, 10)
    assert rows.shape == (3, 10)
    rows[1].fill_(7)
    assert slot.view[10:20].tolist() == [7] * 10


@pytest.mark.parametrize(
    ("pool_bytes", "slot_bytes", "load_slots"), [(100, 64, 1), (4 * 64, 64, 0), (4 * 64, 64, 4)]
)
def test_pool_geometry_is_checked(pool_bytes: int, slot_bytes: int, load_slots: int) -> None:
    """A pool needs two slots and room for at least one load slot and one save slot."""
    with pytest.raises(ValueError, match="slot"):
        StagingPool(pool_bytes, slot_bytes, load_slots=load_slots)


def test_free_slots_are_counted_per_kind() -> None:
    """free_slots tracks takes and releases of each kind separately."""
    pool = StagingPool(5 * 16, 16, load_slots=2)
    assert (pool.free_slots("load"), pool.free_slots("save")) == (2, 3)
    slot = pool.try_take("save")
    assert slot is not None and slot.kind == "save"
    assert (pool.free_slots("load"), pool.free_slots("save")) == (2, 2)
    pool.release(slot)
    assert (pool.free_slots("load"), pool.free_slots("save")) == (2, 3)


def test_saves_never_take_load_slots() -> None:
    """With every save slot taken, saves find nothing although load slots are free."""
    pool = StagingPool(4 * 16, 16, load_slots=2)
    taken = [pool.try_take("save"), pool.try_take("save")]
    assert all(slot is not None for slot in taken)
    assert pool.try_take("save") is None
    assert pool.free_slots("load") == 2
    load = pool.try_take("load")
    assert load is not None and load.index < 2
    assert {slot.index for slot in taken if slot} == {2, 3}


async def test_take_waits_when_exhausted_and_resumes_on_release() -> None:
    """take blocks while no slot of its kind is free and gets the one released next."""
    pool = StagingPool(3 * 16, 16, load_slots=1)
    got: list[Slot] = []
    with anyio.fail_after(TIMEOUT_S):
        first = await pool.take("save")
        second = await pool.take("save")
        async with anyio.create_task_group() as tg:

            async def take_third() -> None:
                got.append(await pool.take("save"))

            tg.start_soon(take_third)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            assert pool.free_slots("load") == 1  # a free load slot does not unblock it
            pool.release(second)
    assert [slot.index for slot in got] == [second.index]
    assert first.index != second.index


async def test_saves_waiting_do_not_delay_a_load() -> None:
    """A load is served from its reserved slot while saves are blocked on an empty pool."""
    pool = StagingPool(2 * 16, 16, load_slots=1)
    with anyio.fail_after(TIMEOUT_S):
        save = await pool.take("save")
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.take, "save")
            await anyio.wait_all_tasks_blocked()
            with anyio.fail_after(0.5):
                load = await pool.take("load")
            assert load.kind == "load"
            pool.release(save)
