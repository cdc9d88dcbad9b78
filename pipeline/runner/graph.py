"""The stage graph, declared as data and wired by the runner.

A path is a list of ``StageSpec`` entries (name, factory, config section). The runner
gives every stage an inbox bounded by its section's ``inbox_size``, starts its workers,
and joins each stage's outbox to the next one's inbox; a path that answers engines ends
in the sink. Adding a stage is one entry plus its module.

A one-stage path may also be run inline (``Graph.run_inline``): the sender's task runs
the stage and the sink itself while the path's inbox is empty, sparing a cheap item the
hand-off to a worker and back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from pipeline.core.config import StageConfig, StagesConfig
from pipeline.runner.edges import Edge, EdgeSendStream, create_edge
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

__all__ = ["BatchSpec", "Graph", "GraphRow", "PathSpec", "StageSpec"]

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
    """Its items may be run in the sender's task (``Graph.run_inline``): one stage, no
    batching."""


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
        for path in self._paths:
            if not path.stages:
                raise ValueError(f"path {path.name!r} has no stages")
            if path.inline and (len(path.stages) > 1 or isinstance(path.stages[0], BatchSpec)):
                raise ValueError(f"path {path.name!r}: only a path of one stage, not a "
                                 "batching one, can run inline")
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
        self._inline: dict[str, Callable[[Any], Awaitable[None]]] = {}
        """Paths runnable inline, while their stages run: item -> processed and sunk."""

    def entrance(self, path: str) -> EdgeSendStream[Any]:
        """Where the path's items go in (its first stage's inbox)."""
        return self._edges[path][0].outbox

    async def run_inline(self, path: str, item: Any) -> bool:
        """Run ``item`` through ``path`` in this task, as its worker would, and hand the
        output to the sink; True once done. False, having done nothing, while the path's
        inbox holds items (they go first) or its stage is not running inline (not
        started, drained, or behind a fault point): send the item to the entrance then.
        The item counts as having waited 0 s in the inbox."""
        run = self._inline.get(path)
        edge = self._edges[path][0]
        if run is None or edge.queued():
            return False
        edge.bypassed()
        await run(item)
        return True

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
        for index, spec in enumerate(path.stages):
            inbox = edges[index].inbox
            outbox = edges[index + 1].outbox if index + 1 < len(edges) else None
            name = f"{path.name}.{spec.name}"
            if isinstance(spec, BatchSpec):
                if outbox is None:
                    raise ValueError(f"stage {name}: a batching stage cannot end a path")
                batching = spec.build(resources)
                tg.start_soon(
                    functools.partial(
                        run_batcher, inbox, outbox, group_of=batching.group_of,
                        limit_of=batching.limit_of, deadline_s=batching.deadline_s,
                        new_batch=batching.new_batch,
                    ),
                    name=f"stage.{name}",
                )
                continue
            stage_sink = sink if path.replies and outbox is None else None
            fault = before(f"stage.{spec.name}")
            process = wrapped(spec.build(resources).process, name, on_failure=on_failure,
                              before=fault, on_done=on_done)
            start_stage(tg, name, process, inbox, outbox, workers=self._workers(spec),
                        sink=stage_sink)
            if path.inline and fault is None:  # a fault point delays its stage's workers
                self._inline[path.name] = functools.partial(_run_inline, process, stage_sink)



async def _run_inline(process: Callable[[Any], Awaitable[Any]], sink: Sink | None,
                      item: Any) -> None:
    result = await process(item)
    if result is not None and sink is not None:
        await sink(result)
