"""The stage graph, declared as data and run by the runner.

A path is a list of stages (``StageSpec``, ``BatchSpec``), each with a rule saying when
it waits for an item (``WaitRule``): on another thread, on the store, or for other
items to batch with. One rule runs every path:

    A task holding an item runs the next stage itself, unless that stage waits for the
    item; then the item goes to the stage's inbox, for the stage's workers, which carry
    on the same way with its output.

The sender of an item (``Graph.entrance``) is the first such task. A stage that never
waits so runs in the task of whoever hands it an item, without a hop through the event
loop; a stage that may wait has an inbox bounded by its config section's
``inbox_size`` and that many ``workers``. The route of an item depends on the config
and on the item, never on how full an inbox is. A path that answers engines hands its
last outputs to the sink.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from pipeline.core.config import StageConfig, StagesConfig
from pipeline.runner.edges import Edge, create_edge
from pipeline.runner.forward import Entrance, Forward, OnFull, Step, Waits
from pipeline.runner.stages import (
    Batching,
    OnDone,
    OnFailure,
    Sink,
    Stage,
    run_batcher,
    start_stage,
    wrapped,
)

__all__ = [
    "ALWAYS", "NEVER", "BatchSpec", "Entrance", "Graph", "GraphRow",
    "PathSpec", "StageSpec", "WaitRule",
]

R = TypeVar("R")
"""What the stage factories are built from (the root's resources)."""


@dataclasses.dataclass(frozen=True)
class WaitRule(Generic[R]):
    """When a stage waits for an item: ``text`` for ``kvsidecar graph``, and the test,
    built from the root's resources."""

    text: str
    build: Callable[[R], Waits]


def _waits_always(item: object) -> bool:
    return True


def _waits_never(item: object) -> bool:
    return False


ALWAYS: WaitRule[Any] = WaitRule("always", lambda resources: _waits_always)
"""The stage is reached only through its inbox (it waits on something for every item)."""
NEVER: WaitRule[Any] = WaitRule("never", lambda resources: _waits_never)
"""The stage runs in whichever task hands it an item; it has no workers."""


@dataclasses.dataclass(frozen=True)
class StageSpec(Generic[R]):
    name: str
    build: Callable[[R], Stage[Any, Any]]
    section: str
    """The stage's section under ``stages:`` in the config (inbox_size, workers)."""
    waits: WaitRule[R] = ALWAYS


@dataclasses.dataclass(frozen=True)
class BatchSpec(Generic[R]):
    """A batching stage. With a deadline (items wait for more to join them) one task
    regroups its inbox into batches (``run_batcher``); without one it never waits, and
    whoever holds an item batches what that item brings."""

    name: str
    build: Callable[[R], Batching[Any]]
    section: str


@dataclasses.dataclass(frozen=True)
class PathSpec(Generic[R]):
    name: str
    stages: Sequence[StageSpec[R] | BatchSpec[R]]
    replies: bool = False
    """The last stage's outputs are replies, handed to the sink."""
    when_full: str = "wait"
    """What happens to an item the sender hands to a full inbox, as ``kvsidecar graph``
    prints it."""
    on_full: Callable[[R], OnFull] | None = None
    """Built from the root's resources: what the sender does with an item a full inbox
    cannot take, instead of waiting for room (None: it waits). Workers always wait."""


@dataclasses.dataclass(frozen=True)
class GraphRow:
    """One wired stage, as ``kvsidecar graph`` prints it."""

    path: str
    stage: str
    workers: int
    inbox: int
    when_full: str
    to: str
    waits: str = "always"
    """When an item goes to the stage's inbox (else: run by whoever hands it over)."""


class Graph(Generic[R]):
    """The declared paths with their edges; ``run`` starts every stage once."""

    def __init__(self, paths: Sequence[PathSpec[R]], config: StagesConfig) -> None:
        self._paths = list(paths)
        self._sections: dict[str, StageConfig] = {}
        for path in self._paths:
            if not path.stages:
                raise ValueError(f"path {path.name!r} has no stages")
            for spec in path.stages:
                section = getattr(config, spec.section, None)
                if not isinstance(section, StageConfig):
                    raise ValueError(f"stage {path.name}.{spec.name}: no stage config "
                                     f"section {spec.section!r}")
                self._sections[spec.section] = section
        self._edges: dict[str, list[Edge[Any]]] = {
            path.name: [create_edge(self._sections[spec.section].inbox_size)
                        for spec in path.stages]
            for path in self._paths
        }
        self._entrances = {path.name: Entrance() for path in self._paths}
        self._handoff: dict[str, int] = {}
        """Each path's first stage that waits for every item, as the config declares it."""
        for path in self._paths:
            index = next((i for i, spec in enumerate(path.stages)
                          if _declared(spec, self._sections)[1] is True), None)
            if index is not None:
                self._handoff[path.name] = index

    def entrance(self, path: str) -> Entrance:
        """Where the path's items go in (a send waits for ``run`` to start the path)."""
        return self._entrances[path]

    def room(self, path: str) -> int:
        """Items the path takes now without its sender waiting: the room left in the
        inbox of its first stage that waits for every item (where the sender hands over
        all items but those an earlier stage waits for on their own account)."""
        index = self._handoff.get(path)
        if index is None:
            return 1 << 30
        edge = self._edges[path][index]
        return edge.size - edge.queued()

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
                waits, every = _declared(spec, self._sections)
                rows.append(GraphRow(
                    path=path.name,
                    stage=spec.name,
                    workers=0 if every is False else self._workers(spec),
                    inbox=0 if every is False else self._edges[path.name][index].size,
                    when_full=path.when_full if index == self._handoff.get(path.name)
                    else "wait",
                    to=("sink" if path.replies else "settles jobs") if last
                    else path.stages[index + 1].name,
                    waits=waits,
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
        async with anyio.create_task_group() as tg:
            for path in self._paths:
                self._start(tg, path, resources=resources, sink=sink, on_failure=on_failure,
                            before=before, on_done=on_done)

    def _start(
        self, tg: TaskGroup, path: PathSpec[R], *, resources: R, sink: Sink,
        on_failure: OnFailure,
        before: Callable[[str], Callable[[], Awaitable[None]] | None],
        on_done: OnDone | None,
    ) -> None:
        edges = self._edges[path.name]
        path_sink = sink if path.replies else None
        steps: list[Step] = []
        workers: list[Callable[[Forward], None]] = []  # each started with its onward path
        for spec, edge in zip(path.stages, edges, strict=True):
            name = f"{path.name}.{spec.name}"
            if isinstance(spec, BatchSpec):
                batching = spec.build(resources)
                if batching.deadline_s > 0:
                    steps.append(Step(_unreachable, _waits_always))
                    workers.append(functools.partial(_start_batcher, tg, name, batching,
                                                     edge))
                else:
                    steps.append(Step(functools.partial(_batches, batching), _waits_never))
                    workers.append(functools.partial(_no_workers, edge))
                continue
            process = wrapped(spec.build(resources).process, name, on_failure=on_failure,
                              before=before(f"stage.{spec.name}"), on_done=on_done)
            waits = spec.waits.build(resources)
            steps.append(Step(functools.partial(_processed, process), waits))
            if spec.waits is NEVER:
                workers.append(functools.partial(_no_workers, edge))
            else:
                workers.append(functools.partial(
                    _start_workers, tg, name, process, edge, self._workers(spec)))
        # Each task that may hand an item to an inbox holds a sending end of it: the
        # entrance every one, a stage's workers those after their own.
        for index, start in enumerate(workers):
            start(Forward(steps, [edge.outbox.clone() for edge in edges[index + 1 :]],
                           index + 1, path_sink))
        self._entrances[path.name]._open(
            Forward(steps, [edge.outbox.clone() for edge in edges], 0, path_sink,
                     None if path.on_full is None else path.on_full(resources)))
        for edge in edges:
            edge.outbox.close()


def _declared(spec: StageSpec[Any] | BatchSpec[Any],
              sections: dict[str, StageConfig]) -> tuple[str, bool | None]:
    """When the stage waits, as the config declares it: the text ``kvsidecar graph``
    prints, and whether for every item (True), for none (False) or for some (None). A
    batching stage's comes from its section's ``deadline_ms``."""
    if isinstance(spec, StageSpec):
        rule = spec.waits
        return rule.text, True if rule is ALWAYS else False if rule is NEVER else None
    deadline_ms = getattr(sections[spec.section], "deadline_ms", 0)
    if deadline_ms > 0:
        return f"{ALWAYS.text} ({deadline_ms:g} ms for more items)", True
    return f"{NEVER.text} (no deadline)", False


async def _unreachable(item: object) -> Sequence[Any]:
    raise AssertionError("a stage that always waits is run by its workers")


def _no_workers(edge: Edge[Any], onward: Forward) -> None:
    """A stage that never waits: nothing is ever sent to its inbox."""
    edge.inbox.close()
    onward.close()


def _start_workers(tg: TaskGroup, name: str, process: Callable[[Any], Awaitable[Any]],
                   edge: Edge[Any], workers: int, onward: Forward) -> None:
    start_stage(tg, name=name, process=process, inbox=edge.inbox, outbox=onward,
                workers=workers)


def _start_batcher(tg: TaskGroup, name: str, batching: Batching[Any], edge: Edge[Any],
                   onward: Forward) -> None:
    tg.start_soon(
        functools.partial(
            run_batcher, edge.inbox, onward, group_of=batching.group_of,
            limit_of=batching.limit_of, deadline_s=batching.deadline_s,
            new_batch=batching.new_batch,
        ),
        name=f"stage.{name}",
    )


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
