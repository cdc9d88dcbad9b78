"""What moves through the pipeline: a job (one accepted save or load) and its block tasks,
the batches stages pass on, lookups, and the replies that answer them.

A job is accepted once and completed exactly once (``pipeline.state.jobs.JobTracker``).
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from pipeline.core.errors import StoreError
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.hitrule import blocks_to_load
from pipeline.core.layout import NULL_BLOCK_ID
from pipeline.core.messages import BlockReport, Load, Lookup, LookupReply, Save, SidecarMessage
from pipeline.core.outcomes import (
    STORE_FULL,
    BlockStatus,
    KeyOutcome,
    store_error_outcome,
)
from pipeline.core.runs import Run, held, lent_count, select
from pipeline.core.seams import Values
from pipeline.state.sessions import EngineSession

if TYPE_CHECKING:
    from pipeline.state.jobs import JobTracker

__all__ = [
    "BlockTask",
    "Failable",
    "Job",
    "LookupRequest",
    "Reply",
    "StagedBatch",
    "StorePressure",
    "TaskBatch",
    "live",
    "load_bytes",
    "mark_done",
    "planned_blocks",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """A message for one engine, and the request it answers."""

    session: EngineSession
    message: SidecarMessage
    request: Job | LookupRequest

    @property
    def received_at(self) -> float:
        return self.request.received_at

    @property
    def to(self) -> bytes:
        """The peer the reply goes to: the engine, or whoever asked on its behalf."""
        if isinstance(self.request, LookupRequest) and self.request.reply_to:
            return self.request.reply_to
        return self.session.identity


class Failable(Protocol):
    """An item in flight that can fail as a whole: it gives back what it holds and
    settles its blocks (or returns the reply that answers it)."""

    async def fail(self, error: StoreError, tracker: JobTracker) -> Reply | None: ...


@dataclasses.dataclass(slots=True, eq=False)
class BlockTask:
    """One engine block to move: where it lives in the engine and its key in the store."""

    job: Job
    store_group: int
    block_index: int
    block_id: int
    key: str = ""
    block_hash: bytes = b""
    parent_hash: bytes | None = None
    """The hash of the group's previous block (None for block 0): named with the key."""
    outcome: KeyOutcome | None = None
    """What came of the block, once settled."""

    @property
    def geometry(self) -> StoreGroupGeometry:
        # Looked up, not held: a task that outlives its job (a stage's last item) must
        # not keep the engine's memory mapped once its session has let go of it.
        return self.job.session.store_groups[self.store_group]


@dataclasses.dataclass(slots=True, eq=False)
class Job:
    session: EngineSession
    message: Save | Load
    planned: list[BlockTask] = dataclasses.field(default_factory=list)
    """Every block the job settles, fixed by the group filter."""
    reports: list[BlockReport] = dataclasses.field(default_factory=list)
    pending: int = 0
    done: bool = False
    received_at: float = dataclasses.field(default_factory=time.monotonic)
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    """When each stage last finished a part of the job (``path.stage``: monotonic s)."""
    stop: KeyOutcome | None = None
    """Why the job was stopped (cancelled, deadline, session closed, shutdown): no copy
    of its blocks starts any more, nothing it copied is stored, and its blocks not yet
    settled are settled with this once no copy of them is in flight."""
    copying: int = 0
    """Batches of its blocks inside a copy of engine memory now (``JobTracker.enter``)."""
    cancels: list[int] = dataclasses.field(default_factory=list)
    """Seqs of the engine's ``Cancel``s of it, answered once its completion is sent."""

    @property
    def is_load(self) -> bool:
        return isinstance(self.message, Load)

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` past which no copy of it starts (0: none)."""
        return self.message.deadline

    def report(self, task: BlockTask, outcome: KeyOutcome) -> BlockReport:
        kv_group_id = self.session.store_groups[task.store_group].kv_group_id
        return BlockReport(
            kv_group_id, task.block_index, task.block_id, outcome.status, outcome.reason
        )

    async def fail(self, error: StoreError, tracker: JobTracker) -> None:
        if not self.planned and self.pending == 0:
            tracker.plan(self, planned_blocks(self))
        if not self.planned:  # nothing to move: the job is answered as it is
            await tracker.settle(self, ())
            return
        await TaskBatch(self.planned).fail(error, tracker)


def planned_blocks(job: Job) -> list[BlockTask]:
    """The blocks a job moves: per store group, in block order, null blocks left out.
    Saves move every block; loads the blocks each store group needs to resume at
    ``num_tokens`` (the hit rule), nothing more."""
    session = job.session
    projected = session.layout.project_block_ids(job.message.block_ids)
    tasks: list[BlockTask] = []
    for store_group, block_ids in enumerate(projected):
        if isinstance(job.message, Load):
            wanted = _loaded(session.store_groups[store_group], job.message)
            indices: Iterable[int] = (j for j in wanted if j < len(block_ids))
        else:
            indices = range(len(block_ids))
        tasks.extend(
            BlockTask(job, store_group, j, block_ids[j])
            for j in indices
            if block_ids[j] != NULL_BLOCK_ID
        )
    return tasks


def load_bytes(session: EngineSession, message: Load) -> int:
    """The most bytes a load moves: the blocks each store group needs (as
    ``planned_blocks`` finds them, null blocks counted)."""
    return sum(len(_loaded(geometry, message)) * geometry.stored_bytes
               for geometry in session.store_groups)


def _loaded(geometry: StoreGroupGeometry, message: Load) -> range:
    """The blocks of a store group a load writes (the hit rule's ``blocks_to_load``)."""
    return blocks_to_load(geometry.group, message.num_tokens, message.computed_tokens) or range(0)


class TaskBatch(list[BlockTask]):
    """Named blocks on their way to the store: one job's, or (batched) one store group's
    of one session."""

    async def fail(self, error: StoreError, tracker: JobTracker) -> None:
        if self:
            saving = not self[0].job.is_load
            await tracker.settle_all(self, store_error_outcome(error, saving=saving))


@dataclasses.dataclass(slots=True, eq=False)
class StagedBatch:
    """A batch of one session's store group with a value per block."""

    tasks: list[BlockTask]
    runs: list[Run]
    """Value i belongs to tasks[i]: ``geometry.stored_bytes`` long."""
    values: Values
    """The memory the values live in, given back through it."""

    @classmethod
    def split(
        cls, tasks: Sequence[BlockTask], values: Values, usable: BlockStatus
    ) -> tuple[StagedBatch | None, list[BlockTask], list[KeyOutcome]]:
        """The tasks whose value is usable (lent, outcome ``usable``) as a batch, and
        the others with their outcomes. With none usable the batch is None and the
        memory is given back."""
        statuses = [outcome.status for outcome in values.outcomes]
        if statuses.count(usable) == len(tasks) == lent_count(values.runs):  # the usual batch
            return cls(list(tasks), values.runs, values), [], []
        usable_at = [has and status is usable for has, status
                     in zip(held(values.runs, len(tasks)), statuses, strict=True)]
        positions = [position for position, ok in enumerate(usable_at) if ok]
        refused = [task for task, ok in zip(tasks, usable_at, strict=True) if not ok]
        outcomes = [outcome for outcome, ok in zip(values.outcomes, usable_at, strict=True)
                    if not ok]
        if not positions:
            values.release()
            return None, refused, outcomes
        kept = [tasks[position] for position in positions]
        return cls(kept, select(values.runs, positions), values), refused, outcomes

    @property
    def geometry(self) -> StoreGroupGeometry:
        return self.tasks[0].geometry

    @property
    def session(self) -> EngineSession:
        return self.tasks[0].job.session

    def abandoned(self) -> bool:
        """Whether a job of the batch was stopped or answered before its blocks were
        settled: the engine may be reusing them already."""
        return any(task.job.done or task.job.stop is not None for task in self.tasks)

    @property
    def block_ids(self) -> list[int]:
        return [task.block_id for task in self.tasks]

    async def fail(self, error: StoreError, tracker: JobTracker) -> None:
        self.values.release()
        await TaskBatch(self.tasks).fail(error, tracker)


@dataclasses.dataclass(frozen=True, slots=True)
class LookupRequest:
    session: EngineSession
    message: Lookup
    received_at: float = dataclasses.field(default_factory=time.monotonic)
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    """As ``Job.marks``."""
    reply_to: bytes = b""
    """The peer that asked on the engine's behalf (``Explain``); empty: the engine."""

    async def fail(self, error: StoreError, tracker: JobTracker) -> Reply:
        """A lookup the store could not answer is a miss."""
        return Reply(self.session, LookupReply(self.message.seq, 0), self)


_JOB = operator.attrgetter("job")


def live(tasks: Sequence[BlockTask]) -> list[BlockTask]:
    """The tasks whose job is not yet answered: a stage drops the others unread (their
    session may have let go of its memory and geometry already)."""
    return [task for task in tasks if not task.job.done]


def mark_done(stage: str, item: object) -> None:
    """Note that ``stage`` has finished its part of the requests ``item`` carries (a job,
    a lookup, or a batch of blocks of one or more jobs)."""
    now = time.monotonic()
    if isinstance(item, Job | LookupRequest):
        item.marks[stage] = now
        return
    tasks = item.tasks if isinstance(item, StagedBatch) else item
    if isinstance(tasks, list) and tasks and isinstance(tasks[0], BlockTask):
        for job in set(map(_JOB, tasks)):
            job.marks[stage] = now


class StorePressure:
    """Requests whose blocks met a full store skip their further saves without copying,
    until some batch is stored again (then the store has room to try)."""

    def __init__(self) -> None:
        self._requests: set[tuple[int, str]] = set()

    @staticmethod
    def _request(task: BlockTask) -> tuple[int, str]:
        return id(task.job.session), task.job.message.request_id

    def record(self, tasks: Sequence[BlockTask], outcomes: Sequence[KeyOutcome]) -> None:
        if any(o.status is BlockStatus.STORED for o in outcomes):
            self._requests.clear()
        if STORE_FULL in outcomes:
            self._requests.update(self._request(t) for t, o in zip(tasks, outcomes, strict=True)
                                  if o == STORE_FULL)

    def split(self, tasks: list[BlockTask]) -> tuple[list[BlockTask], list[BlockTask]]:
        """(tasks to skip as store_full, tasks to save)."""
        if not self._requests:
            return [], tasks
        skip = [t for t in tasks if self._request(t) in self._requests]
        return skip, [t for t in tasks if self._request(t) not in self._requests]
