"""The stage graph of a sidecar, declared: one list of stages per path.

    save:   group_filter → hashing → dedup → batching → transfer → commit
            (values moved in place: no dedup; the put checks what the store holds)
    load:   group_filter → hashing → batching → fetch → scatter
    lookup: lookup → sink
    save.completion, load.completion: completion → sink   (every job settles here)

Each entry names its stage, how it is built from the root's resources, and its config
section; the runner wires them (``pipeline.runner.Graph``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping

import anyio
from rich.console import Console
from rich.table import Table

from pipeline.app.backends import moves_in_place
from pipeline.core.config import Config
from pipeline.core.seams import BatchMemory, CopyEngine, Count
from pipeline.core.store import KVStore
from pipeline.runner import BatchSpec, Graph, PathSpec, StageSpec
from pipeline.state.events import KVEventLog
from pipeline.state.history import BlockHistory
from pipeline.state.jobs import JobTracker, StorePressure
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

__all__ = [
    "LOAD_COMPLETION", "SAVE_COMPLETION", "Resources", "build_graph", "paths", "show_graph",
]


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
    after_copy: Callable[[], Awaitable[None]] | None = None
    """Awaited between a save batch's copy and its check (fault point
    ``transfer.copied``)."""


Spec = StageSpec[Resources]

GROUP_FILTER = Spec("group_filter", lambda r: GroupFilterStage(r.tracker), "group_filter")
HASHING = Spec("hashing", lambda r: HashingStage(r.tracker, r.hash_limiter), "hashing")
BATCHING = BatchSpec[Resources](
    "batching", lambda r: BatchingStage(r.config.stages.batching, r.slot_bytes), "batching"
)
COMPLETION = Spec("completion", lambda r: CompletionStage(r.tracker), "completion")

SAVE = (
    GROUP_FILTER,
    HASHING,
    Spec("dedup", lambda r: DedupStage(r.store, r.tracker), "dedup"),
    BATCHING,
    Spec("transfer", lambda r: TransferStage(
        r.memory, r.save_copy, r.tracker, r.pressure,
        yield_to_loads_s=r.config.stages.transfer.yield_to_loads_ms / 1000,
        copied=r.moved("save", "copy"), after_copy=r.after_copy,
    ), "transfer"),
    Spec("commit", lambda r: CommitStage(
        r.memory, r.store, r.tracker, r.pressure, r.events, stored=r.moved("save", "store"),
        reads_engine=moves_in_place(r.config),
    ), "commit"),
)
LOAD = (
    GROUP_FILTER,
    HASHING,
    BATCHING,
    Spec("fetch", lambda r: FetchStage(r.memory, r.tracker, fetched=r.moved("load", "store"),
                                       writes_engine=moves_in_place(r.config)), "fetch"),
    Spec("scatter", lambda r: ScatterStage(
        r.store, r.load_copy, r.tracker, r.events, copied=r.moved("load", "copy"),
    ), "scatter"),
)
LOOKUP = (Spec("lookup", lambda r: LookupStage(
    r.store, r.value_sizes, r.history, probe_first=r.answers_at_once,
), "lookup"),)

SAVE_COMPLETION, LOAD_COMPLETION = "save.completion", "load.completion"
"""Finished jobs' lanes: a load's reply never queues behind a backlog of save replies.
A finished job is answered by whoever finished it, while its lane is idle
(``Graph.inline_first``): its reply does not wait behind everything else ready on the
event loop."""


def paths(config: Config) -> list[PathSpec[Resources]]:
    receive = config.stages.receive
    when_full = (
        f"answer skipped(overloaded) (also past {receive.max_saves_per_engine} per engine)"
        if receive.overflow == "skip" else "wait (stop reading the socket)"
    )
    # Dedup spares copying what the store holds. A value moved in place is not copied,
    # and the put checks what the store holds in the same call, without a hop of its own.
    save = tuple(s for s in SAVE if s.name != "dedup") if moves_in_place(config) else SAVE
    return [
        # A lookup with nothing to hash, and a load that waits on nothing, are run by the
        # receiver itself when they can be (Receiver._lookup, Receiver._run_job): the
        # hand-offs to the workers would cost more than the work. A save, and a load
        # whose copy waits on other threads, are run up to their copy, and handed to it;
        # a save not while batches wait for more (a batching deadline). The transfer
        # worker then commits a save itself while nothing else waits for it.
        PathSpec("save", save, when_full=when_full,
                 inline=config.stages.batching.deadline_ms == 0, inline_until="transfer"),
        PathSpec("load", LOAD, when_full="wait (loads are never dropped)", inline=True,
                 inline_until="scatter"),
        PathSpec("lookup", LOOKUP, replies=True, inline=True),
        PathSpec(SAVE_COMPLETION, (COMPLETION,), replies=True, fed_by_stages=True,
                 inline=True),
        PathSpec(LOAD_COMPLETION, (COMPLETION,), replies=True, fed_by_stages=True,
                 inline=True),
    ]


def build_graph(config: Config) -> Graph[Resources]:
    return Graph(paths(config), config.stages)


def show_graph(config: Config) -> None:
    """Print the graph as ``config`` wires it: each stage, its workers, its inbox's
    bound and what happens to an item offered to a full inbox; then the backends."""
    table = Table(title="kvsidecar stage graph")
    for column in ("path", "stage", "workers", "inbox", "when full", "next"):
        table.add_column(column, justify="right" if column in ("workers", "inbox") else "left")
    for row in build_graph(config).rows():
        table.add_row(row.path, row.stage, str(row.workers), str(row.inbox), row.when_full,
                      row.to)
    console = Console()
    console.print(table)
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
    console.print(f"batch memory: {memory}")
    work = "checksums in place" if in_place else "cpu"
    console.print(f"copy engine: {work}, {config.stages.transfer.threads} threads for saves "
                  f"and {config.stages.transfer.threads} for loads")
