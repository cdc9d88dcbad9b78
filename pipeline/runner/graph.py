"""The stage graph, declared as data and wired by the runner.

A path is a list of ``StageSpec`` entries (name, factory, config section). The runner
gives every stage an inbox bounded by its section's ``inbox_size``, starts its workers,
and joins each stage's outbox to the next one's inbox; a path that answers engines ends
in the sink. Adding a stage is one entry plus its module.

A path may also be run inline (``Graph.run_inline``): the sender's task runs the stages
and the sink itself while nothing is queued on the path, sparing a cheap item the
hand-off to each stage's worker and back. On a busy event loop each hand-off waits for
everything ready before it, so a path of five stages waits five times. An item whose
work waits on other threads runs inline only up to the path's ``inline_until`` stage,
and is handed to that stage's inbox: the sender never waits on a copy. A worker of that
stage or a later one runs the stages after its own the same way, in its own task, while
they are idle and nothing waits for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from pipeline.core.config import StageConfig, StagesConfig
from pipeline.runner.edges import Edge, EdgeReceiveStream, EdgeSendStream, create_edge
from pipeline.runner.stages import (
    Batching,
    OnDone,
    OnFailure,
    Sink,
    Stage,
    finished_here,
    run_batcher,
    start_stage,
    wrapped,
)

__all__ = ["BatchSpec", "Graph", "GraphRow", "InlineFirst", "PathSpec", "StageSpec"]

R = TypeVar("R")
"""What the stage factories are built from (the root's resources)."""


@dataclasses.dataclass(frozen=True)
class StageSpec(Generic[R]):
    name: str
    build: Callable[[R], Stage[Any, Any]]
    section: str
    """The stage's section under ``stages:`` in the config (inbox_size, workers)."""


@dataclasses.dataclass(frozen=True)
class BatchSpec(Generic[R]):
    """A batching stage: one task regroups its inbox into batches (``run_batcher``)."""

    name: str
    build: Callable[[R], Batching[Any]]
    section: str


@dataclasses.dataclass(frozen=True)
class PathSpec(Generic[R]):
    name: str
    stages: Sequence[StageSpec[R] | BatchSpec[R]]
    replies: bool = False
    """The last stage's outputs are replies, handed to the sink."""
    fed_by_stages: bool = False
    """Its items come from the other paths' stages (completions): its inbox closes once
    they have all drained."""
    when_full: str = "wait"
    """What happens to an item offered to the path's full inbox."""
    inline: bool = False
    """Its items may be run in the sender's task (``Graph.run_inline``)."""
    inline_until: str | None = None
    """The stage an item run inline stops before when not run whole (its work waits on
    other threads): the item is handed to that stage's inbox."""


@dataclasses.dataclass(frozen=True)
class GraphRow:
    """One wired stage, as ``kvsidecar graph`` prints it."""

    path: str
    stage: str
    workers: int
    inbox: int
    when_full: str
    to: str


class Graph(Generic[R]):
    """The declared paths with their edges; ``run`` starts every stage once."""

    def __init__(self, paths: Sequence[PathSpec[R]], config: StagesConfig) -> None:
        self._paths = list(paths)
        self._sections: dict[str, StageConfig] = {}
        self._until: dict[str, int] = {}
        """Where a path's runs that are not whole stop: ``inline_until``'s index."""
        for path in self._paths:
            if not path.stages:
                raise ValueError(f"path {path.name!r} has no stages")
            for spec in path.stages:
                section = getattr(config, spec.section, None)
                if not isinstance(section, StageConfig):
                    raise ValueError(f"stage {path.name}.{spec.name}: no stage config "
                                     f"section {spec.section!r}")
                self._sections[spec.section] = section
            names = [spec.name for spec in path.stages]
            if path.inline_until is not None and path.inline_until not in names[1:]:
                raise ValueError(f"path {path.name!r}: inline_until {path.inline_until!r} "
                                 f"is none of its stages after the first")
            self._until[path.name] = (len(names) if path.inline_until is None
                                      else names.index(path.inline_until))
        self._edges: dict[str, list[Edge[Any]]] = {
            path.name: [create_edge(self._sections[spec.section].inbox_size)
                        for spec in path.stages]
            for path in self._paths
        }
        self._inline: dict[str, _InlinePath] = {}
        """Paths runnable inline, while their stages run."""

    def entrance(self, path: str) -> EdgeSendStream[Any]:
        """Where the path's items go in (its first stage's inbox)."""
        return self._edges[path][0].outbox

    async def run_inline(self, path: str, item: Any, *, whole: bool = True) -> bool:
        """Run ``item`` through ``path`` in this task, stage after stage as the workers
        would (a batching stage batches what the item brings), and hand the outputs to
        the sink; True once done. Not ``whole``: only the stages before the path's
        ``inline_until``, whose inbox then takes the outputs. False, having done nothing,
        while any inbox the item would pass holds items (they go first), the inbox it
        would be handed to is full, or the path's stages are not running inline (not
        started, its entrance closed, or one behind a fault point): send the item to the
        entrance then. The item counts as having waited 0 s in each inbox it passed."""
        inline = self._inline.get(path)
        edges = self._edges[path]
        if inline is None or edges[0].outbox.closed:
            return False
        stop = len(edges) if whole else inline.until
        handed_to = edges[stop] if stop < len(edges) else None
        if handed_to is not None and (inline.doors.closed
                                      or handed_to.queued() >= handed_to.size):
            return False
        if any(edge.queued() for edge in edges[:stop]):
            return False
        for edge in edges[:stop]:
            edge.bypassed()
        with inline.doors.running():
            end = inline.sink if handed_to is None else inline.doors[stop].send
            await _run_inline(inline.steps[:stop], end, item)
        return True

    async def _run_rest(self, path: str, start: int, item: Any) -> bool:
        """The output of a worker of the stage before ``start``, through ``path`` from
        ``start`` on in the worker's own task, while a worker of that stage waits idle
        (it would take the item at once: the hand-off would only cost a trip through the
        event loop, behind everything ready on it) and nothing is queued from the
        worker's own inbox on (it has nothing else to do meanwhile); True once done.
        False, having done nothing, otherwise: the item goes to the stage's inbox."""
        inline = self._inline.get(path)
        edges = self._edges[path]
        if (inline is None or not edges[start].idle_workers()
                or any(edge.queued() for edge in edges[start - 1 :])):
            return False
        for edge in edges[start:]:
            edge.bypassed()
        await _run_inline(inline.steps[start:], inline.sink, item)
        return True

    def inline_first(self, path: str) -> InlineFirst:
        """An entrance to ``path`` that runs each item inline when it can."""
        return InlineFirst(self, path)

    def inboxes(self) -> list[tuple[str, str, Edge[Any]]]:
        """``(path, stage, edge)``: every stage's inbox, for watching queue depths."""
        return [
            (path.name, spec.name, edge)
            for path in self._paths
            for spec, edge in zip(path.stages, self._edges[path.name], strict=True)
        ]

    def rows(self) -> list[GraphRow]:
        rows = []
        for path in self._paths:
            for index, spec in enumerate(path.stages):
                last = index == len(path.stages) - 1
                rows.append(GraphRow(
                    path=path.name,
                    stage=spec.name,
                    workers=self._workers(spec),
                    inbox=self._edges[path.name][index].size,
                    when_full=path.when_full if index == 0 else "wait",
                    to=("sink" if path.replies else "settles jobs") if last
                    else path.stages[index + 1].name,
                ))
        return rows

    def _workers(self, spec: StageSpec[R] | BatchSpec[R]) -> int:
        return 1 if isinstance(spec, BatchSpec) else self._sections[spec.section].workers

    async def run(
        self,
        resources: R,
        *,
        sink: Sink,
        on_failure: OnFailure,
        before: Callable[[str], Callable[[], Awaitable[None]] | None] = lambda point: None,
        on_done: OnDone | None = None,
    ) -> None:
        """Run every stage until the paths' entrances close and they have drained.

        ``before(point)`` gives the fault point run ahead of each item of stage
        ``stage.<name>`` (None: none); ``on_done("path.stage", item)`` hears each item a
        stage has processed."""
        fed = [path for path in self._paths if path.fed_by_stages]
        start = functools.partial(self._start, resources=resources, sink=sink,
                                  on_failure=on_failure, before=before, on_done=on_done)
        try:
            async with anyio.create_task_group() as outer:
                for path in fed:
                    start(outer, path)
                async with anyio.create_task_group() as tg:
                    for path in self._paths:
                        if not path.fed_by_stages:
                            start(tg, path)
                # Every other stage has drained: nothing can feed these paths any more.
                for path in fed:
                    self.entrance(path.name).close()
        finally:
            self._inline.clear()

    def _start(
        self, tg: TaskGroup, path: PathSpec[R], *, resources: R, sink: Sink,
        on_failure: OnFailure,
        before: Callable[[str], Callable[[], Awaitable[None]] | None],
        on_done: OnDone | None,
    ) -> None:
        edges = self._edges[path.name]
        steps: list[_Step] = []  # the path's stages, as run inline
        faulty = False  # a fault point delays its stage's workers: no item runs inline
        # Cloned before the stages close their ends: inline runs hand items on through
        # these, and the stages downstream drain only once they are closed too.
        doors = _Doors(edges[1:]) if path.inline else None
        for index, spec in enumerate(path.stages):
            inbox = edges[index].inbox
            outbox = edges[index + 1].outbox if index + 1 < len(edges) else None
            name = f"{path.name}.{spec.name}"
            start: Callable[[TaskGroup], None]
            if isinstance(spec, BatchSpec):
                if outbox is None:
                    raise ValueError(f"stage {name}: a batching stage cannot end a path")
                batching = spec.build(resources)
                start = functools.partial(_start_batcher, name, batching, inbox, outbox)
                steps.append(functools.partial(_batches, batching))
            else:
                stage_sink = sink if path.replies and outbox is None else None
                fault = before(f"stage.{spec.name}")
                process = wrapped(spec.build(resources).process, name, on_failure=on_failure,
                                  before=fault, on_done=on_done)
                # A worker past the stages the sender runs inline passes its outputs on
                # the same way, while the next stage is idle.
                pass_on = (functools.partial(self._run_rest, path.name, index + 1)
                           if path.inline and self._until[path.name] <= index else None)
                start = functools.partial(start_stage, name=name, process=process,
                                          inbox=inbox, outbox=outbox,
                                          workers=self._workers(spec), sink=stage_sink,
                                          pass_on=pass_on)
                steps.append(functools.partial(_processed, process))
                faulty = faulty or fault is not None
            if index == 0 and doors is not None:
                tg.start_soon(_then, start, doors.entrance_drained, name=f"stage.{name}")
            else:
                start(tg)
        if doors is None:
            return
        if faulty:
            doors.entrance_drained()  # no item will run inline: the doors go unused
            return
        self._inline[path.name] = _InlinePath(
            steps, sink if path.replies else None, doors, self._until[path.name])


class InlineFirst:
    """A path's entrance that runs each item in the sender's task when the path can take
    it now (``Graph.run_inline``), and queues it otherwise."""

    def __init__(self, graph: Graph[Any], path: str) -> None:
        self._graph = graph
        self._path = path

    async def send(self, item: Any) -> None:
        finished_here(item)  # the stage sending it may answer it before it returns
        if not await self._graph.run_inline(self._path, item):
            await self._graph.entrance(self._path).send(item)


_Step = Callable[[Any], Awaitable[Sequence[Any]]]
"""One stage as an item runs inline: its outputs for the next (none: dropped)."""


class _Doors:
    """A path's inboxes past its entrance, as inline runs hand items to them: clones of
    their sending ends, kept open while a run may still use one. That is until the
    path's first stage has ended (its entrance was closed and has drained: no run can
    start) and no run is in flight; the stages downstream drain once they are closed."""

    def __init__(self, edges: Sequence[Edge[Any]]) -> None:
        self._outboxes = [edge.outbox.clone() for edge in edges]
        self._runs = 0
        self._drained = False
        self.closed = False

    def __getitem__(self, index: int) -> EdgeSendStream[Any]:
        """The door into the path's ``index``-th inbox (1: the second stage's)."""
        return self._outboxes[index - 1]

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._runs += 1
        try:
            yield
        finally:
            self._runs -= 1
            self._close_if_unused()

    def entrance_drained(self) -> None:
        self._drained = True
        self._close_if_unused()

    def _close_if_unused(self) -> None:
        if self._drained and not self._runs and not self.closed:
            self.closed = True
            for outbox in self._outboxes:
                outbox.close()


@dataclasses.dataclass(frozen=True)
class _InlinePath:
    steps: Sequence[_Step]
    sink: Sink | None
    doors: _Doors
    until: int
    """Where a run that is not whole stops: the index of ``inline_until``'s stage."""


def _start_batcher(name: str, batching: Batching[Any], inbox: EdgeReceiveStream[Any],
                   outbox: EdgeSendStream[Any], tg: TaskGroup) -> None:
    tg.start_soon(
        functools.partial(
            run_batcher, inbox, outbox, group_of=batching.group_of,
            limit_of=batching.limit_of, deadline_s=batching.deadline_s,
            new_batch=batching.new_batch,
        ),
        name=f"stage.{name}",
    )


async def _then(start: Callable[[TaskGroup], None], ended: Callable[[], None]) -> None:
    """The tasks ``start`` starts, in a task group of their own; ``ended`` once all have
    ended."""
    try:
        async with anyio.create_task_group() as tg:
            start(tg)
    finally:
        ended()


async def _processed(process: Callable[[Any], Awaitable[Any]], item: Any) -> Sequence[Any]:
    result = await process(item)
    return () if result is None else (result,)


async def _batches(batching: Batching[Any], items: Sequence[Any]) -> Sequence[list[Any]]:
    """One item's list, regrouped as the batcher would with nothing else queued: one
    batch per group, cut where it fills."""
    groups: dict[Hashable, tuple[list[list[Any]], int]] = {}  # group -> (batches, limit)
    for item in items:
        group = batching.group_of(item)
        entry = groups.get(group)
        if entry is None:  # items of one group share a limit (``run_batcher``)
            entry = groups[group] = ([batching.new_batch()], batching.limit_of(item))
        batches, limit = entry
        if len(batches[-1]) >= limit:
            batches.append(batching.new_batch())
        batches[-1].append(item)
    return [batch for batches, _ in groups.values() for batch in batches]


async def _run_inline(steps: Sequence[_Step], sink: Sink | None, item: Any) -> None:
    """``item`` through the steps, depth first (a batch reaches the last stage before the
    next batch starts), each last output to the sink."""
    if not steps:
        if sink is not None:
            await sink(item)
        return
    for output in await steps[0](item):
        await _run_inline(steps[1:], sink, output)
