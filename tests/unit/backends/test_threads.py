"""Worker threads of their own (a store's calls) and a copy direction's native threads:
their priority, cancellation, and what they keep."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio
import numpy
import pytest
import torch

from pipeline.backends.threads import NativeThreads, WorkerThreads

TIMEOUT_S = 10


def own_nice() -> tuple[str, int]:
    """The calling thread's name and nice value."""
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.skipif(sys.platform != "linux", reason="nice is per thread on Linux only")
async def test_threads_run_at_their_own_lower_priority_and_leave_the_callers_alone(
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    lowered, usual = WorkerThreads(2, name="low", nice=5), WorkerThreads(2, name="usual")
    try:
        with anyio.fail_after(TIMEOUT_S):
            [(low_name, low_nice)] = await lowered.run_each([own_nice])
            [(usual_name, usual_nice)] = await usual.run_each([own_nice])
    finally:
        lowered.close()
        usual.close()
    assert low_name.startswith("low") and low_nice == min(19, base + 5)
    assert usual_name.startswith("usual") and usual_nice == base
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the event loop's thread: unchanged


async def test_a_cancelled_caller_waits_for_its_work_to_return() -> None:
    """The work owns the buffers it was given until it returns: a cancelled caller does
    not go on before that."""
    threads = WorkerThreads(1, name="cancel")
    finished: list[float] = []

    def work() -> None:
        time.sleep(0.2)
        finished.append(time.monotonic())

    try:
        with anyio.fail_after(TIMEOUT_S):
            with anyio.move_on_after(0.01) as scope:
                await threads.run_each([work])
            returned = time.monotonic()
    finally:
        threads.close()
    assert scope.cancel_called  # the deadline passed while the work ran
    assert finished and finished[0] <= returned


async def test_a_batch_is_answered_once_every_call_has_returned() -> None:
    """``run_each`` gives each call's result in the calls' order, each call in a worker
    thread. An error is raised only once the other calls have returned too: until then
    they own their buffers."""
    threads = WorkerThreads(2, name="batch")
    finished: list[str] = []

    def slow() -> str:
        time.sleep(0.2)
        finished.append("slow")
        return threading.current_thread().name

    def fails() -> str:
        raise ValueError("this part failed")

    try:
        with anyio.fail_after(TIMEOUT_S):
            names = await threads.run_each([slow, slow])
            with pytest.raises(ValueError, match="this part failed"):
                await threads.run_each([fails, slow])
            assert finished == ["slow"] * 3
            assert await threads.run_each([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
            assert await threads.run_each([]) == []
    finally:
        threads.close()
    assert len(names) == 2 and all(name.startswith("batch") for name in names)
    assert threading.current_thread().name not in names


def test_nothing_of_a_returned_call_is_kept_by_its_idle_thread() -> None:
    """Once a call has returned, its thread, waiting for the next, holds none of its
    arguments: they may be an engine's mapped memory, unmapped only once unreferenced."""

    class Payload:
        pass

    threads = WorkerThreads(1, name="refs")
    payload = Payload()
    gone = weakref.ref(payload)
    try:
        anyio.run(threads.run_each, [functools.partial(lambda held: None, payload)])
        del payload
        deadline = time.monotonic() + 2  # the thread drops it just after answering
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone() is None  # before close(): an exiting thread drops everything
    finally:
        threads.close()


async def test_closed_threads_refuse_new_work() -> None:
    """Work handed to closed threads is refused at once; no thread would ever take it."""
    threads = WorkerThreads(1, name="closed")
    with anyio.fail_after(TIMEOUT_S):
        assert await threads.run_each([lambda: 1]) == [1]
        threads.close()
        with pytest.raises(RuntimeError, match="closed"):
            await threads.run_each([lambda: 2])


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        WorkerThreads(0, name="none")


def copies(source: torch.Tensor, rows: torch.Tensor, values: int) -> list[tuple[Any, ...]]:
    """One native gather per value: row v of ``rows`` from row v of ``source`` (one
    page each, no checksum)."""
    size = source.shape[1]
    table = numpy.array([0], dtype=numpy.int64), numpy.array([size], dtype=numpy.int64)
    return [(numpy.array([[source[v].data_ptr()]], dtype=numpy.int64), rows[v].data_ptr(),
             size, *table, False, 0, size, False) for v in range(values)]


def native_names(ids: list[int]) -> list[str]:
    return [(Path("/proc/self/task") / str(tid) / "comm").read_text().strip() for tid in ids]


@pytest.mark.skipif(sys.platform != "linux", reason="nice is per thread on Linux only")
async def test_native_threads_run_at_their_own_lower_priority_under_their_names() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    source = torch.arange(4 * 64, dtype=torch.uint8).view(4, 64)
    rows = torch.zeros_like(source)
    lowered = NativeThreads(2, name="low", nice=5)
    usual = NativeThreads(2, name="usual")
    try:
        with anyio.fail_after(TIMEOUT_S):
            await lowered.run("gather", copies(source, rows, 4))
            await usual.run("gather", copies(source, rows, 4))
        low, same = lowered.native_ids(), usual.native_ids()
        assert [os.getpriority(os.PRIO_PROCESS, tid) for tid in low] == [min(19, base + 5)] * 2
        assert [os.getpriority(os.PRIO_PROCESS, tid) for tid in same] == [base] * 2
        assert native_names(low) == ["low0", "low1"] and native_names(same) == ["usual0", "usual1"]
    finally:
        lowered.close()
        usual.close()
    assert torch.equal(rows, source)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the event loop's thread: unchanged


def test_native_threads_run_every_copy_once_then_let_go_of_its_buffers() -> None:
    """A batch of copies more than the threads is answered once all have run, each
    byte in place, in one event loop and then in another; nothing a copy was given is
    kept once it is answered."""
    source = torch.randint(0, 256, (64, 4096), dtype=torch.uint8)
    threads = NativeThreads(3, name="batch")
    try:
        for _ in range(2):  # anyio.run: a new event loop each time
            rows = torch.zeros_like(source)
            calls = copies(source, rows, 64)
            pages = weakref.ref(calls[0][0])
            anyio.run(threads.run, "gather", calls)
            assert torch.equal(rows, source)
            del calls
            assert pages() is None
    finally:
        threads.close()


async def test_a_cancelled_caller_waits_for_its_native_copies_to_run() -> None:
    """A copy owns its buffers until it has run: a cancelled caller does not go on
    before every byte is in place."""
    source = torch.randint(0, 256, (16, 8 << 20), dtype=torch.uint8)  # 128 MiB
    rows = torch.zeros_like(source)
    threads = NativeThreads(1, name="cancel")
    try:
        with anyio.fail_after(TIMEOUT_S):
            with anyio.move_on_after(0.001) as scope:
                await threads.run("gather", copies(source, rows, 16))
        assert scope.cancel_called
        assert torch.equal(rows, source)
    finally:
        threads.close()


async def test_closed_native_threads_refuse_new_copies() -> None:
    source = torch.ones(1, 64, dtype=torch.uint8)
    rows = torch.zeros_like(source)
    threads = NativeThreads(1, name="closed")
    with anyio.fail_after(TIMEOUT_S):
        await threads.run("gather", copies(source, rows, 1))
        threads.close()
        with pytest.raises(RuntimeError, match="closed"):
            await threads.run("gather", copies(source, rows, 1))
    with pytest.raises(ValueError, match="at least 1"):
        NativeThreads(0, name="none")
