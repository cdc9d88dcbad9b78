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
    BatchSpec,
    Graph,
    PathSpec,
    StageSpec,
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
        hashing=StageConfig(inbox_size=3, workers=2), batching=BatchingStageConfig(inbox_size=5)
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


async def test_an_inline_path_runs_every_stage_and_batches_as_its_workers_would() -> None:
    """Through several stages and a batcher, run_inline gives the sink what the workers
    would: one batch per group, cut where it fills; while an inbox past the first holds
    items, it does nothing."""
    spread, total = Spread(), GatedTotal()
    graph = Graph[int](
        [PathSpec("p", [StageSpec("spread", lambda r: spread, "hashing"),
                        BatchSpec("batch", lambda r: ByParity(), "batching"),
                        StageSpec("total", lambda r: total, "lookup")],
                  replies=True, inline=True)],
        StagesConfig(lookup=StageConfig(workers=1)),
    )
    replies: list[int] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    async def on_failure(item: int, error: StoreError) -> None:
        raise AssertionError("no item fails here")

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: graph.run(0, sink=sink, on_failure=on_failure))
            await anyio.wait_all_tasks_blocked()
            assert await graph.run_inline("p", 10)
            # evens 10, 12 | 14; odds 11, 13: each group cut at 2, in the caller's task
            assert sorted(replies) == sorted([10 + 12, 14, 11 + 13])
            assert spread.tasks == [anyio.get_current_task().id]
            await graph.entrance("p").send(100)  # its first batch holds the one worker
            await anyio.wait_all_tasks_blocked()
            (_, _, first), _, (_, _, last) = graph.inboxes()
            assert not first.queued() and last.queued()  # the other batches wait there
            assert not await graph.run_inline("p", 20)
            total.gate.set()
            graph.entrance("p").close()
    assert sorted(replies) == sorted([10 + 12, 14, 11 + 13, 100 + 102, 104, 101 + 103])


async def test_an_inline_path_runs_an_item_in_the_senders_task_while_its_inbox_is_empty(
) -> None:
    """run_inline processes the item and sinks its output in the caller's task, counting
    a wait of 0 s on the inbox; before the graph runs, while items are queued, and after
    it drained, it does nothing and says so."""
    stage = Double()
    graph = Graph[int]([PathSpec("p", [StageSpec("double", lambda r: stage, "lookup")],
                                 replies=True, inline=True)],
                       StagesConfig(lookup=StageConfig(workers=1)))
    (_, _, inbox), = graph.inboxes()
    waits: list[float] = []
    inbox.on_wait(waits.append)
    replies: list[int] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    async def on_failure(item: int, error: StoreError) -> None:
        raise AssertionError("no item fails here")

    assert not await graph.run_inline("p", 1)  # not running yet
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: graph.run(0, sink=sink, on_failure=on_failure))
            await anyio.wait_all_tasks_blocked()
            assert await graph.run_inline("p", 3)
            assert replies == [6] and stage.tasks == [anyio.get_current_task().id]
            assert waits == [0.0]
            entrance = graph.entrance("p")
            await entrance.send(100)  # the one worker takes it and waits
            await anyio.wait_all_tasks_blocked()
            await entrance.send(4)  # queued behind it
            assert not await graph.run_inline("p", 5)  # the queued item goes first
            stage.gate.set()
            await anyio.wait_all_tasks_blocked()
            assert replies == [6, 200, 8]
            assert set(stage.tasks[1:]).isdisjoint(stage.tasks[:1])  # by the worker
            entrance.close()
    assert not await graph.run_inline("p", 7)  # drained
    assert replies == [6, 200, 8]


async def test_a_stage_behind_a_fault_point_never_runs_inline() -> None:
    """An injected delay belongs to the stage's workers, not to whoever sends."""
    graph = Graph[int]([PathSpec("p", [StageSpec("double", lambda r: Double(), "lookup")],
                                 replies=True, inline=True)], StagesConfig())
    replies: list[int] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    async def fault() -> None:
        await anyio.lowlevel.checkpoint()

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: graph.run(0, sink=sink, on_failure=None,  # type: ignore[arg-type]
                                            before=lambda point: fault))
            await anyio.wait_all_tasks_blocked()
            assert not await graph.run_inline("p", 3)
            graph.entrance("p").close()
    assert replies == []


def two_doublings(first: Double, second: Double, *, inbox: int = 64) -> Graph[int]:
    """A path of two doublings, run inline up to the second when not run whole."""
    return Graph[int](
        [PathSpec("p", [StageSpec("first", lambda r: first, "hashing"),
                        StageSpec("second", lambda r: second, "lookup")],
                  replies=True, inline=True, inline_until="second")],
        StagesConfig(lookup=StageConfig(workers=1, inbox_size=inbox)),
    )


async def no_failure(item: int, error: StoreError) -> None:
    raise AssertionError("no item fails here")


@contextlib.asynccontextmanager
async def running(graph: Graph[int]) -> AsyncIterator[list[int]]:
    """The graph running, every worker waiting for items, and the replies its sink gets
    as they come; the block closes the path's entrance, and ends once it has drained."""
    replies: list[int] = []

    async def sink(reply: int) -> None:
        replies.append(reply)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: graph.run(0, sink=sink, on_failure=no_failure))
        await anyio.wait_all_tasks_blocked()
        yield replies


async def test_an_item_not_run_whole_is_handed_to_the_stage_its_path_runs_inline_until(
) -> None:
    """Not whole, run_inline runs the stages before inline_until in the caller's task,
    and that stage's worker takes the outputs from its inbox; whole, the caller runs
    every stage."""
    first, second = Double(), Double()
    graph = two_doublings(first, second)
    (_, _, first_inbox), (_, _, second_inbox) = graph.inboxes()
    waits: list[str] = []
    first_inbox.on_wait(lambda s: waits.append("first"))
    second_inbox.on_wait(lambda s: waits.append("second"))
    with anyio.fail_after(TIMEOUT_S):
        async with running(graph) as replies:
            me = anyio.get_current_task().id
            assert await graph.run_inline("p", 3, whole=False)
            assert replies == [] and first.tasks == [me]
            await anyio.wait_all_tasks_blocked()
            assert replies == [12] and second.tasks[0] != me
            assert await graph.run_inline("p", 5)
            assert replies == [12, 20] and second.tasks[1:] == [me]
            graph.entrance("p").close()
    assert waits == ["first", "second", "first", "second"]


async def test_an_item_not_run_whole_goes_behind_queued_items_and_needs_room_where_handed(
) -> None:
    """Refused, having done nothing, while the inbox of a stage it would run holds items,
    and while the inbox it would be handed to is full."""
    first, second = Double(), Double()
    graph = two_doublings(first, second, inbox=1)
    with anyio.fail_after(TIMEOUT_S):
        async with running(graph) as replies:
            entrance = graph.entrance("p")
            await entrance.send(100)  # the first stage's worker waits on its gate
            await anyio.wait_all_tasks_blocked()
            await entrance.send(1)  # queued behind it
            assert not await graph.run_inline("p", 2, whole=False)
            first.gate.set()  # 200 holds the second's worker; 2 waits in its inbox
            await anyio.wait_all_tasks_blocked()
            assert not await graph.run_inline("p", 3, whole=False)  # no room there
            second.gate.set()
            await anyio.wait_all_tasks_blocked()
            assert await graph.run_inline("p", 4, whole=False)
            await anyio.wait_all_tasks_blocked()
            entrance.close()
    assert replies == [400, 4, 16]
    assert first.tasks.count(anyio.get_current_task().id) == 1  # only 4 was run here


async def test_a_path_drains_only_once_an_inline_run_in_flight_has_handed_its_item_on(
) -> None:
    """The entrance closed and drained while a run not whole waits in the first stage:
    the run still hands its item to the second stage, the path drains after it, and no
    run starts once the entrance is closed."""
    first, second = Double(), Double()
    second.gate.set()
    graph = two_doublings(first, second)
    replies: list[int] = []
    drained = anyio.Event()

    async def sink(reply: int) -> None:
        replies.append(reply)

    async def run_graph() -> None:
        await graph.run(0, sink=sink, on_failure=no_failure)
        drained.set()

    async def run_inline(item: int) -> None:
        assert await graph.run_inline("p", item, whole=False)

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_graph)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(run_inline, 100)  # waits on the first stage's gate
            await anyio.wait_all_tasks_blocked()
            graph.entrance("p").close()
            # The first stage's end reaches the graph some loop turns after its worker's.
            await anyio.sleep(0.2)
            assert not drained.is_set()
            assert not await graph.run_inline("p", 1, whole=False)
            assert not await graph.run_inline("p", 1)
            first.gate.set()
            await drained.wait()
    assert replies == [400]


async def test_a_worker_past_inline_until_runs_an_idle_next_stage_itself_unless_work_waits(
) -> None:
    """A worker of the stage a path runs inline until passes its output through the next
    stage in its own task while that stage's worker waits idle and nothing is queued
    from the worker's own inbox on; with an item queued behind it, or the next stage's
    only worker busy, it hands the output to the next stage's inbox."""
    first, second, third = Double(), Double(), Double()
    graph = Graph[int](
        [PathSpec("p", [StageSpec("first", lambda r: first, "hashing"),
                        StageSpec("second", lambda r: second, "lookup"),
                        StageSpec("third", lambda r: third, "commit")],
                  replies=True, inline=True, inline_until="second")],
        StagesConfig(lookup=StageConfig(workers=1), commit=StageConfig(workers=1)),
    )
    waits: list[float] = []
    graph.inboxes()[2][2].on_wait(waits.append)
    with anyio.fail_after(TIMEOUT_S):
        async with running(graph) as replies:
            assert await graph.run_inline("p", 1, whole=False)
            await anyio.wait_all_tasks_blocked()
            assert replies == [8] and third.tasks == second.tasks  # one worker's task
            assert waits == [0.0]  # counted as passed through, not waited in
            assert await graph.run_inline("p", 50, whole=False)  # 100 waits in second
            await anyio.wait_all_tasks_blocked()
            assert await graph.run_inline("p", 2, whole=False)  # 4 queued behind it
            second.gate.set()  # 200 goes to third's inbox, as 4 waits in second's;
            await anyio.wait_all_tasks_blocked()  # then 8 too: third's worker holds 200
            [worker] = set(second.tasks)
            assert replies == [8] and len(third.tasks) == 2 and third.tasks[1] != worker
            third.gate.set()
            await anyio.wait_all_tasks_blocked()
            assert replies == [8, 400, 16] and worker not in third.tasks[1:]
            graph.entrance("p").close()


def test_a_path_runs_inline_until_one_of_its_later_stages() -> None:
    for until in ("first", "third"):
        with pytest.raises(ValueError, match="inline_until"):
            Graph[int]([PathSpec("p", [StageSpec("first", lambda r: Double(), "hashing"),
                                       StageSpec("second", lambda r: Double(), "lookup")],
                                 inline=True, inline_until=until)], StagesConfig())
