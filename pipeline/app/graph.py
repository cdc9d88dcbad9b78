"""The stage graph of a sidecar, declared: one list of stages per path.

    save:   group_filter → hashing → dedup → batching → transfer → commit
            (values moved in place: no dedup; the put checks what the store holds)
    load:   group_filter → hashing → batching → fetch → scatter
    lookup: lookup → sink

Each entry names its stage, how it is built from the root's resources, its config
section, and when it waits (``pipeline.runner``: a stage that does not wait for an item
runs in the task that hands it over). With the embedded store and no fault points, a
request hashed on the event loop so runs in the receive loop up to its copy, and the
worker that copies it commits it; a job is answered by whichever stage settles its last
block (``AnswerWhereFinished``). While saves are shed, the receive loop never waits for
room: a save's job or batch that finds its inbox full is answered overloaded.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping

import anyio
from rich.console import Console
from rich.table import Table

from pipeline.app.backends import answers_at_once, moves_in_place
from pipeline.core.config import Config
from pipeline.core.hashing import hashed_inline
from pipeline.core.messages import Load, Lookup, Save
from pipeline.core.outcomes import OVERLOADED
from pipeline.core.seams import BatchMemory, CopyEngine, Count
from pipeline.core.store import KVStore
from pipeline.runner import (
    ALWAYS,
    NEVER,
    BatchSpec,
    Graph,
    PathSpec,
    StageSpec,
    WaitRule,
)
from pipeline.runner.stages import Sink, finished_here
from pipeline.state.admission import Admission
from pipeline.state.events import KVEventLog
from pipeline.state.history import BlockHistory
from pipeline.state.jobs import (
    BlockTask,
    Job,
    JobTracker,
    LookupRequest,
    StagedBatch,
    StorePressure,
    mark_done,
)
from stages.batching import BatchingStage
from stages.commit import CommitStage
from stages.completion import CompletionStage
from stages.dedup import DedupStage
from stages.fetch import FetchStage
from stages.group_filter import GroupFilterStage
from stages.hashing import HashingStage
from stages.lookup import LookupStage
from stages.scatter import ScatterStage
from stages.transfer import TransferStage

__all__ = ["AnswerWhereFinished", "Resources", "build_graph", "paths", "show_graph"]


@dataclasses.dataclass(frozen=True)
class Resources:
    """What the stages are built from, chosen once at the root."""

    config: Config
    store: KVStore
    memory: BatchMemory
    save_copy: CopyEngine
    load_copy: CopyEngine
    tracker: JobTracker
    pressure: StorePressure
    hash_limiter: anyio.CapacityLimiter
    slot_bytes: int
    events: KVEventLog
    value_sizes: Mapping[str, Mapping[str, int]]
    """Bytes of a stored value under each key prefix of the engines registered."""
    moved: Callable[[str, str], Count]
    """What counts the bytes moved on a path (save, load) via copies or store calls."""
    history: BlockHistory
    answers_at_once: bool
    """The store's queries wait on nothing (in-process): a query costs only its keys."""
    where: Callable[[str], str] | None = None
    """Where the store keeps the value under a key (``in memory``, ``on disk``), for
    explanations; None: the store does not say."""
    after_copy: Callable[[], Awaitable[None]] | None = None
    """Awaited between a save batch's copy and its check (fault point
    ``transfer.copied``)."""


Spec = StageSpec[Resources]


def hashed_on_the_loop(message: Lookup | Save | Load) -> bool:
    """Whether a request's blocks are hashed on the event loop, not in a thread: the
    engine sent its hashes, or the prompt is short (``core.hashing.hashed_inline``)."""
    return message.block_hashes is not None or hashed_inline(len(message.token_ids),
                                                             message.keys)


HASHED_IN_A_THREAD = WaitRule[Resources](
    "for a long prompt (hashed in a thread)",
    lambda r: lambda job: not hashed_on_the_loop(job.message),
)


def _store_waits(config: Config) -> WaitRule[Resources]:
    """A store call waits unless the store answers at once (``backends.answers_at_once``;
    a fault point of any name wraps the store in one that may delay)."""
    return NEVER if answers_at_once(config.store.backend,
                                    faults_on=bool(config.faults.points)) else ALWAYS


def _lookup_waits(request: LookupRequest) -> bool:
    return request.message.explain or not hashed_on_the_loop(request.message)


def _lookup_rule(config: Config) -> WaitRule[Resources]:
    if _store_waits(config) is ALWAYS:
        return ALWAYS
    return WaitRule("for a long prompt or an explanation", lambda r: _lookup_waits)


SCATTER_WAITS = WaitRule[Resources](
    "for a large copy (copy threads)",
    lambda r: lambda batch: r.load_copy.waits(_batch_bytes(batch)),
)


def _batch_bytes(batch: StagedBatch) -> int:
    return len(batch.tasks) * batch.geometry.stored_bytes


def _stages(config: Config) -> tuple[tuple[Spec | BatchSpec[Resources], ...], ...]:
    """The save, load and lookup paths' stages under ``config``."""
    store = _store_waits(config)
    group_filter = Spec("group_filter", lambda r: GroupFilterStage(r.tracker), "group_filter",
                        NEVER)
    hashing = Spec("hashing", lambda r: HashingStage(r.tracker, r.hash_limiter), "hashing",
                   HASHED_IN_A_THREAD)
    batching = BatchSpec[Resources](
        "batching", lambda r: BatchingStage(r.config.stages.batching, r.slot_bytes), "batching"
    )
    in_place = moves_in_place(config)
    save = (
        group_filter,
        hashing,
        # Dedup spares copying what the store holds. A value moved in place is not
        # copied, and the put checks what the store holds in the same call.
        *(() if in_place else (
            Spec("dedup", lambda r: DedupStage(r.store, r.tracker), "dedup", store),)),
        batching,
        Spec("transfer", lambda r: TransferStage(
            r.memory, r.save_copy, r.tracker, r.pressure,
            yield_to_loads_s=r.config.stages.transfer.yield_to_loads_ms / 1000,
            copied=r.moved("save", "copy"), after_copy=r.after_copy,
        ), "transfer"),
        Spec("commit", lambda r: CommitStage(
            r.memory, r.store, r.tracker, r.pressure, r.events,
            stored=r.moved("save", "store"), reads_engine=in_place,
        ), "commit", store),
    )
    load = (
        group_filter,
        hashing,
        batching,
        Spec("fetch", lambda r: FetchStage(r.memory, r.tracker,
                                           fetched=r.moved("load", "store"),
                                           writes_engine=in_place), "fetch", store),
        Spec("scatter", lambda r: ScatterStage(
            r.store, r.load_copy, r.tracker, r.events, copied=r.moved("load", "copy"),
        ), "scatter", SCATTER_WAITS),
    )
    lookup = (Spec("lookup", lambda r: LookupStage(
        r.store, r.value_sizes, r.history, probe_first=r.answers_at_once, where=r.where,
    ), "lookup", _lookup_rule(config)),)
    return save, load, lookup


def _with_fault_points(config: Config, stages: tuple[Spec | BatchSpec[Resources], ...],
                       ) -> tuple[Spec | BatchSpec[Resources], ...]:
    """A stage behind a fault point (``stage.<name>``) waits for every item: an injected
    delay holds the stage's workers, never the task that hands the item over."""
    points = config.faults.points
    return tuple(dataclasses.replace(spec, waits=ALWAYS)
                 if isinstance(spec, StageSpec) and f"stage.{spec.name}" in points else spec
                 for spec in stages)


async def _shed(tracker: JobTracker, item: Job | list[BlockTask]) -> None:
    """A save's job, or one of its batches, that found its stage's inbox full while
    shedding: its blocks are answered ``skipped(overloaded)``, as a refused save's are."""
    await tracker.settle_all(item.planned if isinstance(item, Job) else list(item), OVERLOADED)


def paths(config: Config) -> list[PathSpec[Resources]]:
    receive = config.stages.receive
    shed = receive.overflow == "skip"
    when_full = (
        f"answer skipped(overloaded) (also past {receive.max_saves_per_engine} per engine)"
        if shed else "wait (stop reading the socket)"
    )
    save, load, lookup = (_with_fault_points(config, stages) for stages in _stages(config))
    return [
        PathSpec("save", save, when_full=when_full,
                 on_full=(lambda r: functools.partial(_shed, r.tracker)) if shed else None),
        PathSpec("load", load, when_full="wait (loads are never dropped)"),
        PathSpec("lookup", lookup, replies=True),
    ]


class AnswerWhereFinished:
    """Where finished jobs go (``JobTracker``'s lane): the task that settles a job's last
    block builds its completion and hands it to the sink at once, whatever stage it
    runs. A reply never waits for a hop through the event loop."""

    def __init__(self) -> None:
        self._completion: CompletionStage | None = None
        self._sink: Sink | None = None

    def bind(self, tracker: JobTracker, sink: Sink) -> None:
        """Answer through ``tracker``'s completions into ``sink`` (the receiver's)."""
        self._completion = CompletionStage(tracker)
        self._sink = sink

    async def send(self, job: Job) -> None:
        assert self._completion is not None and self._sink is not None, "bind() first"
        finished_here(job)  # the stage sending it answers it before it returns
        reply = await self._completion.process(job)
        mark_done("completion", job)
        if reply is not None:
            await self._sink(reply)


def build_graph(config: Config) -> Graph[Resources]:
    return Graph(paths(config), config.stages)


def show_graph(config: Config) -> None:
    """Print the graph as ``config`` wires it: each stage, when it waits for an item
    (else it runs in the task that hands the item over), its workers, its inbox's bound
    and what happens to an item offered to a full path; then admission and the
    backends."""
    table = Table(title="kvsidecar stage graph", caption=(
        "A task holding an item runs the next stage itself unless that stage waits for "
        "it; then the item goes to the stage's inbox, for its workers. The receive loop "
        "is the first such task."))
    for column in ("path", "stage", "waits", "workers", "inbox", "when full", "next"):
        table.add_column(column, justify="right" if column in ("workers", "inbox") else "left")
    for row in build_graph(config).rows():
        table.add_row(row.path, row.stage, row.waits, str(row.workers) if row.workers else "-",
                      str(row.inbox) if row.inbox else "-", row.when_full, row.to)
    console = Console()
    console.print(table)
    receive = config.stages.receive
    console.print(
        "admission: loads and lookups as they are read; a save read while frames wait is "
        f"held behind them ({Admission.MAX_HELD} at most); saves "
        + (f"past {receive.max_saves_per_engine} per engine, or finding their inbox full, "
           "are answered skipped (overloaded)" if receive.overflow == "skip"
           else "wait for room (the socket is not read meanwhile)"))
    store = config.store
    slots = (f"staging pool, {config.staging.pool_bytes // config.staging.slot_bytes} "
             f"slots of {config.staging.slot_bytes >> 20} MiB "
             f"({config.staging.load_slots} for loads); "
             f"a save finding none: {config.stages.transfer.overflow}")
    in_place = moves_in_place(config)
    if store.backend == "embedded":
        memory = "lent by the store (one copy each way)"
    elif in_place:
        memory = f"engine blocks moved in place; their checksums in a {slots}"
    else:
        memory = slots
    console.print(f"store: {store.backend} behind a circuit breaker "
                  f"(call timeout {store.breaker.call_timeout_s:g} s), "
                  f"{store.value_format} values, checksums {'on' if store.checksum else 'off'}")
    disk = store.disk
    if store.backend == "embedded" and disk.path:
        console.print(
            f"disk tier: {disk.path}, {disk.bytes / 2**30:g} GiB in segments of "
            f"{disk.segment_bytes >> 20} MiB (the oldest goes whole); every value the store "
            f"takes is written behind it ({disk.writers} writers, batches up to "
            f"{disk.batch_bytes >> 20} MiB, queue {disk.max_queued_bytes >> 20} MiB; past it a "
            f"value waits in memory, skipped if evicted first); loads read from disk on "
            f"{disk.readers} threads of their own, checked first; promote: {disk.promote}")
    console.print(f"batch memory: {memory}")
    work = "checksums in place" if in_place else "cpu"
    console.print(f"copy engine: {work}, {config.stages.transfer.threads} threads for saves "
                  f"and {config.stages.transfer.threads} for loads")
