"""A copy direction's own worker threads: their priority, and cancellation."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref

import anyio
import pytest

from pipeline.backends.threads import WorkerThreads

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
