"""The stage runner: bounded edges, EndOfStream cascading through workers, the batcher."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import ObjectReceiveStream, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.config import BatchingStageConfig, StageConfig, StagesConfig
from pipeline.core.errors import InternalFailure, StoreError
from pipeline.runner import (
    ALWAYS,
    NEVER,
    BatchSpec,
    Graph,
    PathSpec,
    StageSpec,
    WaitRule,
    create_edge,
    run_batcher,
    start_stage,
)

TIMEOUT_S = 5


def ends(size: int) -> tuple[MemoryObjectSendStream[Any], MemoryObjectReceiveStream[Any]]:
    """A new edge's two ends: the producer's outbox, the consumer's inbox."""
    edge = create_edge(size)
    return edge.outbox, edge.inbox


async def collect(inbox: ObjectReceiveStream[Any]) -> list[Any]:
    """Everything a stream yields until it ends."""
    async with inbox:
        return [item async for item in inbox]


# -- edges ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, math.inf])
def test_edges_must_be_finite_and_positive(size: float) -> None:
    """An edge of size 0, negative or infinite is refused."""
    with pytest.raises(ValueError, match="finite and positive"):
        create_edge(size)  # type: ignore[arg-type]


def test_an_edge_holds_exactly_its_size() -> None:
    """An edge of size 2 takes two items without a reader, and refuses a third."""
    send, receive = ends(2)
    with send, receive:
        send.send_nowait(1)
        send.send_nowait(2)
        with pytest.raises(anyio.WouldBlock):
            send.send_nowait(3)
        assert [receive.receive_nowait(), receive.receive_nowait()] == [1, 2]


# -- start_stage ----------------------------------------------------------------------------


async def test_end_of_stream_cascades_through_chained_workers() -> None:
    """Closing the source ends every stage in turn; every item passes and Nones are dropped."""
    source_send, source_receive = ends(4)
    middle_send, middle_receive = ends(4)
    sink_send, sink_receive = ends(4)
    seen: list[int] = []

    async def double(item: int) -> int:
        seen.append(item)
        await anyio.lowlevel.checkpoint()
        return item * 2

    async def drop_multiples_of_four(item: int) -> int | None:
        return None if item % 4 == 0 else item

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_stage(tg, "double", double, source_receive, middle_send, workers=3)
            start_stage(tg, "filter", drop_multiples_of_four, middle_receive, sink_send, workers=2)

            async def feed() -> None:
                async with source_send:
                    for item in range(40):
                        await source_send.send(item)

            tg.start_soon(feed)
            result = await collect(sink_receive)
    assert sorted(seen) == list(range(40))
    assert sorted(result) == [2 * i for i in range(40) if (2 * i) % 4]


async def test_a_sink_stage_ends_when_its_inbox_ends() -> None:
    """A stage without an outbox consumes its inbox and its workers return on EndOfStream."""
    send, receive = ends(2)
    consumed: list[int] = []

    async def consume(item: int) -> None:
        consumed.append(item)

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_stage(tg, "sink", consume, receive, None, workers=2)
            async with send:
                for item in range(10):
                    await send.send(item)
    assert sorted(consumed) == list(range(10))


async def test_start_stage_closes_the_original_streams() -> None:
    """The runner's originals are closed, so only the workers' clones keep the edges open."""
    inbox_send, inbox = ends(1)
    outbox, outbox_receive = ends(1)

    async def identity(item: int) -> int:
        return item

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_stage(tg, "identity", identity, inbox, outbox)
            with pytest.raises(anyio.ClosedResourceError):
                inbox.receive_nowait()
            with pytest.raises(anyio.ClosedResourceError):
                outbox.send_nowait(0)
            inbox_send.close()
            assert await collect(outbox_receive) == []


# -- run_batcher ----------------------------------------------------------------------------


def by_letter(item: str) -> str:
    return item[0]


def start_batcher(
    tg: TaskGroup,
    inbox: MemoryObjectReceiveStream[Any],
    outbox: MemoryObjectSendStream[Any],
    *,
    limit: int,
    deadline_s: float,
) -> None:
    """Run a batcher grouping items by first letter, ``limit`` items to a batch."""
    tg.start_soon(
        lambda: run_batcher(
            inbox, outbox, group_of=by_letter, limit_of=lambda _: limit, deadline_s=deadline_s
        )
    )


async def test_batcher_flushes_as_soon_as_a_batch_is_full() -> None:
    """A group reaching its limit is sent at once, long before the deadline."""
    send, receive = ends(4)
    out_send, out_receive = ends(4)
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_batcher(tg, receive, out_send, limit=2, deadline_s=60.0)
            await send.send(["a1", "a2", "a3"])
            with anyio.fail_after(1):
                assert await out_receive.receive() == ["a1", "a2"]
            send.close()
            assert await collect(out_receive) == [["a3"]]


async def test_batcher_flushes_a_partial_batch_at_its_deadline() -> None:
    """A lone item waits about deadline_s, then goes out alone while the input stays open."""
    send, receive = ends(4)
    out_send, out_receive = ends(4)
    deadline_s = 0.05
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_batcher(tg, receive, out_send, limit=100, deadline_s=deadline_s)
            started = anyio.current_time()
            await send.send(["a1"])
            assert await out_receive.receive() == ["a1"]
            waited = anyio.current_time() - started
            send.close()
            assert await collect(out_receive) == []
    assert deadline_s * 0.9 <= waited < 2.0


async def test_batcher_deadline_counts_from_the_oldest_item() -> None:
    """Items arriving steadily do not postpone a partial batch past its first item's deadline."""
    send, receive = ends(4)
    out_send, out_receive = ends(64)
    deadline_s = 0.1

    async def trickle() -> None:
        async with send:
            for index in range(25):  # about 0.5 s of steady input, never a full batch
                await send.send([f"a{index}"])
                await anyio.sleep(0.02)

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_batcher(tg, receive, out_send, limit=1000, deadline_s=deadline_s)
            started = anyio.current_time()
            tg.start_soon(trickle)
            first = await out_receive.receive()
            waited = anyio.current_time() - started
            rest = await collect(out_receive)
    assert waited < 0.4
    assert first + [item for batch in rest for item in batch] == [f"a{i}" for i in range(25)]


async def test_batcher_keeps_groups_apart() -> None:
    """Interleaved groups come out as batches of one group each."""
    send, receive = ends(4)
    out_send, out_receive = ends(8)
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_batcher(tg, receive, out_send, limit=2, deadline_s=60.0)
            await send.send(["a1", "b1", "a2"])
            await send.send(["b2", "c1"])
            send.close()
            batches = await collect(out_receive)
    assert sorted(batches) == [["a1", "a2"], ["b1", "b2"], ["c1"]]


async def test_batcher_flushes_everything_when_input_ends() -> None:
    """Partial batches of every group go out at end of input, then the outbox ends."""
    send, receive = ends(4)
    out_send, out_receive = ends(8)
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            start_batcher(tg, receive, out_send, limit=10, deadline_s=60.0)
            await send.send(["a1", "b1"])
            await send.send(["a2"])
            send.close()
            batches = await collect(out_receive)
    assert sorted(batches) == [["a1", "a2"], ["b1"]]


@settings(max_examples=60, deadline=None)
@given(
    lists=st.lists(
        st.lists(
            st.sampled_from("abc").flatmap(lambda g: st.integers(0, 99).map(lambda n: f"{g}{n}")),
            max_size=6,
        ),
        max_size=8,
    ),
    limit=st.integers(1, 4),
)
def test_batcher_partitions_its_input(lists: list[list[str]], limit: int) -> None:
    """Output batches hold every item once, one group each, at most limit, in arrival order."""

    async def run() -> list[list[str]]:
        send, receive = ends(len(lists) + 1)
        out_send, out_receive = ends(100)
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                start_batcher(tg, receive, out_send, limit=limit, deadline_s=60.0)
                async with send:
                    for items in lists:
                        await send.send(items)
                return await collect(out_receive)

    batches = anyio.run(run)
    flat = [item for items in lists for item in items]
    assert sorted(item for batch in batches for item in batch) == sorted(flat)
    for batch in batches:
        assert 0 < len(batch) <= limit
        assert len({by_letter(item) for item in batch}) == 1
    for letter in "abc":
        merged = [item for batch in batches for item in batch if by_letter(item) == letter]
        assert merged == [item for item in flat if by_letter(item) == letter]


# -- the declared graph ---------------------------------------------------------------------


class Add:
    """Upstream of a batcher, items travel in lists."""

    def __init__(self, amount: int) -> None:
        self.amount = amount

    async def process(self, item: int) -> list[int]:
        if item < 0:
            raise StoreError("negative")
        if item == 0:
            raise ZeroDivisionError("a bug")
        return [item + self.amount]


class ByParity:
    deadline_s = 60.0  # flushed only when full or when the input ends

    def group_of(self, item: int) -> int:
        return item % 2

    def limit_of(self, item: int) -> int:
        return 2

    def new_batch(self) -> list[int]:
        return []


class Total:
    async def process(self, batch: list[int]) -> int:
        return sum(batch)


def add_batch_total(config: StagesConfig) -> Graph[int]:
    """One replying path: add the resource to each item, batch by parity, sum each batch."""
    return Graph[int](
        [PathSpec("p", [StageSpec("add", lambda r: Add(r), "hashing"),
                        BatchSpec("batch", lambda r: ByParity(), "batching"),
                        StageSpec("total", lambda r: Total(), "lookup")], replies=True)],
        config,
    )


def test_a_graph_sizes_each_inbox_from_its_stage_config() -> None:
    """Each stage's inbox is bounded by its own section; batching runs as one task."""
    config = StagesConfig(
        hashing=StageConfig(inbox_size=3, workers=2),
        batching=BatchingStageConfig(inbox_size=5, deadline_ms=60_000.0),
    )
    graph = add_batch_total(config)
    assert [(r.stage, r.workers, r.inbox, r.to) for r in graph.rows()] == [
        ("add", 2, 3, "batch"), ("batch", 1, 5, "total"), ("total", 4, 64, "sink")]


def test_a_graph_refuses_a_stage_without_a_config_section() -> None:
    """A stage naming no known section is refused when the graph is declared."""
    with pytest.raises(ValueError, match="no stage config section 'nope'"):
        Graph[int]([PathSpec("p", [StageSpec("add", lambda r: Add(r), "nope")])],
                   StagesConfig())


async def test_a_graph_runs_its_paths_into_the_sink_and_fails_items_through_the_policy(
) -> None:
    """Items flow through every stage to the sink; an item meeting a store error is
    answered by the failure policy, whose answer goes on; closing the entrance drains."""
    graph = add_batch_total(StagesConfig())
    replies: list[int] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    async def on_failure(item: int, error: StoreError) -> list[int]:
        return [1000]

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: graph.run(10, sink=sink, on_failure=on_failure))
            entrance = graph.entrance("p")
            for item in (1, 2, 3, -5):
                await entrance.send(item)
            entrance.close()
    # 11 + 13 (odd), 12 + 1000 (even; -5 failed and was answered 1000)
    assert sorted(replies) == [24, 1012]


async def test_a_stage_failing_on_an_item_for_its_own_reason_answers_it_as_internal(
) -> None:
    """An item a stage fails on with an exception of its own (a bug) goes to the failure
    policy as an ``InternalFailure`` caused by it; the stage goes on with the next."""
    graph = add_batch_total(StagesConfig())
    replies: list[int] = []
    failures: list[StoreError] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    async def on_failure(item: int, error: StoreError) -> list[int]:
        failures.append(error)
        return [1000]

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: graph.run(10, sink=sink, on_failure=on_failure))
            entrance = graph.entrance("p")
            for item in (0, 2):
                await entrance.send(item)
            entrance.close()
    [failure] = failures
    assert isinstance(failure, InternalFailure)
    assert isinstance(failure.__cause__, ZeroDivisionError)
    assert sorted(replies) == [1012]


class Double:
    """Doubles an item, noting which task did it; an item of 100 or more waits for
    ``gate``."""

    def __init__(self) -> None:
        self.tasks: list[object] = []
        self.gate = anyio.Event()

    async def process(self, item: int) -> int:
        self.tasks.append(anyio.get_current_task().id)
        if item >= 100:
            await self.gate.wait()
        return 2 * item


class Spread:
    """One item into a list of several, noting which task did it."""

    def __init__(self) -> None:
        self.tasks: list[object] = []

    async def process(self, item: int) -> list[int]:
        self.tasks.append(anyio.get_current_task().id)
        return [item, item + 1, item + 2, item + 3, item + 4]


class GatedTotal:
    """Sums a batch; a sum of 100 or more waits for ``gate``."""

    def __init__(self) -> None:
        self.gate = anyio.Event()

    async def process(self, batch: list[int]) -> int:
        if sum(batch) >= 100:
            await self.gate.wait()
        return sum(batch)


def no_wait_then_doubling(first: Double, second: Double, *,
                          waits: WaitRule[int] = ALWAYS) -> Graph[int]:
    """first (never waits) → second (waits by ``waits``) → sink."""
    return Graph[int](
        [PathSpec("p", [StageSpec("first", lambda r: first, "hashing", NEVER),
                        StageSpec("second", lambda r: second, "lookup", waits)],
                  replies=True)],
        StagesConfig(lookup=StageConfig(workers=1)),
    )


async def no_failure(item: int, error: StoreError) -> None:
    raise AssertionError("no item fails here")


@contextlib.asynccontextmanager
async def running(graph: Graph[int]) -> AsyncIterator[list[int]]:
    """``graph`` running, its path ``p``'s replies collected in the list given; on exit
    the entrance is closed and the graph drained."""
    replies: list[int] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: graph.run(0, sink=sink, on_failure=no_failure))
            yield replies
            graph.entrance("p").close()


async def test_a_stage_that_never_waits_runs_in_the_senders_task_and_one_that_waits_in_its_worker(
) -> None:
    """The sender runs the first stage itself and hands its output to the second's
    inbox; the second's worker runs it and sinks the reply. Nothing is ever queued for
    the stage that never waits, and it has no workers."""
    first, second = Double(), Double()
    graph = no_wait_then_doubling(first, second)
    async with running(graph) as replies:
        for item in (1, 2):
            await graph.entrance("p").send(item)
        await anyio.wait_all_tasks_blocked()
        assert replies == [4, 8]
        assert first.tasks == [anyio.get_current_task().id] * 2
        assert anyio.get_current_task().id not in second.tasks
    assert [(row.stage, row.workers, row.waits) for row in graph.rows()] == [
        ("first", 0, "never"), ("second", 1, "always")]


async def test_a_worker_runs_the_stages_after_its_own_that_do_not_wait() -> None:
    """After a stage that waits, its worker carries the item on through a stage that
    never waits, in its own task."""
    first, second, third = Double(), Double(), Double()
    graph = Graph[int](
        [PathSpec("p", [StageSpec("first", lambda r: first, "hashing"),
                        StageSpec("second", lambda r: second, "lookup", NEVER),
                        StageSpec("third", lambda r: third, "dedup", NEVER)], replies=True)],
        StagesConfig(hashing=StageConfig(workers=1)),
    )
    async with running(graph) as replies:
        await graph.entrance("p").send(3)
        await anyio.wait_all_tasks_blocked()
    assert replies == [24]
    assert first.tasks == second.tasks == third.tasks
    assert first.tasks[0] != anyio.get_current_task().id


async def test_a_rule_sends_each_item_where_the_item_says_never_by_queue_depth() -> None:
    """With a rule that waits for some items only, the others run whole in the sender's
    task, even while the worker's inbox holds items, and those go to the worker."""
    first, second = Double(), Double()
    some = WaitRule[int]("for items 2 mod 4", lambda r: lambda item: item % 4 == 2)
    graph = no_wait_then_doubling(first, second, waits=some)
    replies: list[int] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: graph.run(0, sink=sink, on_failure=no_failure))
            entrance = graph.entrance("p")
            await entrance.send(51)  # 102 waits for the worker, on the gate
            await anyio.wait_all_tasks_blocked()
            await entrance.send(1)  # queued behind it
            await entrance.send(2)  # runs here, ahead of both
            here = anyio.get_current_task().id
            assert replies == [8] and second.tasks[-1] == here
            (_, _, _), (_, _, inbox) = graph.inboxes()
            assert inbox.queued() == 1
            second.gate.set()
            await anyio.wait_all_tasks_blocked()
            entrance.close()
    assert replies == [8, 204, 4]
    assert graph.rows()[1].waits == "for items 2 mod 4"


async def test_a_path_drains_only_once_a_send_in_flight_has_handed_its_item_on() -> None:
    """The entrance closed while a send waits in a stage the sender runs: the send still
    hands its item on, the path drains after it, and no send starts once closed."""
    first, second = Double(), Double()
    second.gate.set()
    graph = no_wait_then_doubling(first, second)
    replies: list[int] = []
    drained = anyio.Event()

    async def sink(reply: int) -> None:
        replies.append(reply)

    async def run_graph() -> None:
        await graph.run(0, sink=sink, on_failure=no_failure)
        drained.set()

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_graph)
            tg.start_soon(graph.entrance("p").send, 100)  # waits on the first stage's gate
            await anyio.wait_all_tasks_blocked()
            graph.entrance("p").close()
            await anyio.sleep(0.2)
            assert not drained.is_set()
            with pytest.raises(anyio.ClosedResourceError):
                await graph.entrance("p").send(1)
            first.gate.set()
            await drained.wait()
    assert replies == [400]


async def test_without_a_deadline_a_batching_stage_batches_what_one_item_brings() -> None:
    """A batching stage with no deadline never waits: whoever holds an item cuts its
    list into batches, one per group, as the batcher would with nothing else queued."""

    class NoDeadline(ByParity):
        deadline_s = 0.0

    spread, total = Spread(), GatedTotal()
    total.gate.set()
    graph = Graph[int](
        [PathSpec("p", [StageSpec("spread", lambda r: spread, "hashing", NEVER),
                        BatchSpec("batch", lambda r: NoDeadline(), "batching"),
                        StageSpec("total", lambda r: total, "lookup", NEVER)],
                  replies=True)],
        StagesConfig(),
    )
    async with running(graph) as replies:
        await graph.entrance("p").send(10)
        # evens 10, 12 | 14; odds 11, 13: each group cut at 2, in this task
        assert sorted(replies) == sorted([10 + 12, 14, 11 + 13])


async def test_room_is_what_is_left_in_the_inbox_every_item_is_handed_to() -> None:
    """The first stage never waits; the second always does: the path's room is what its
    inbox has left, whatever a stage that waits for some items only holds."""
    first, second = Double(), Double()
    graph = no_wait_then_doubling(first, second)
    size = StagesConfig(lookup=StageConfig(workers=1)).lookup.inbox_size
    assert graph.room("p") == size
    async with running(graph) as replies:
        await graph.entrance("p").send(50)  # its worker holds 100 on the gate
        await anyio.wait_all_tasks_blocked()
        await graph.entrance("p").send(1)  # queued
        assert graph.room("p") == size - 1
        second.gate.set()
    assert replies == [200, 4]


async def test_a_sender_with_on_full_never_waits_and_hands_the_overflow_to_it() -> None:
    """With ``on_full``, an item the sender finds no room for in an inbox goes to it at
    once; the sender never waits, and the items taken are processed."""
    first, second = Double(), Double()
    refused: list[int] = []

    async def on_full(item: int) -> None:
        refused.append(item)

    graph = Graph[int](
        [PathSpec("p", [StageSpec("first", lambda r: first, "hashing", NEVER),
                        StageSpec("second", lambda r: second, "lookup")],
                  replies=True, on_full=lambda r: on_full)],
        StagesConfig(lookup=StageConfig(inbox_size=1, workers=1)),
    )
    async with running(graph) as replies:
        await graph.entrance("p").send(50)  # its worker holds 100 on the gate
        await anyio.wait_all_tasks_blocked()
        await graph.entrance("p").send(1)  # fills the inbox of one
        await graph.entrance("p").send(2)  # no room: refused, without waiting
        assert refused == [4]
        second.gate.set()
    assert replies == [200, 4]


async def test_a_rule_that_fails_sends_the_item_to_the_stages_workers() -> None:
    """A rule's own failure never ends the task that asked it: the item goes to the
    stage's inbox, where the stage and its error policy deal with it."""
    first, second = Double(), Double()
    second.gate.set()

    def broken(resources: int) -> Any:
        def waits(item: int) -> bool:
            raise IndexError("a bug in the rule")
        return waits

    graph = no_wait_then_doubling(first, second, waits=WaitRule("broken", broken))
    async with running(graph) as replies:
        await graph.entrance("p").send(3)
        await anyio.wait_all_tasks_blocked()
    assert replies == [12]
    assert anyio.get_current_task().id not in second.tasks
