"""Jobs in flight: one accepted save or load, the blocks it touches, and their outcomes.

A job is accepted once and completed exactly once. Stages settle block outcomes into it;
the settle that leaves nothing pending hands the job to the completion stage. On abort
every job still open is completed with failures, so no accepted request goes unanswered.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

import anyio
from anyio.abc import ObjectSendStream

from pipeline.messages import BlockReport, Load, Save
from pipeline.sessions import EngineSession, StoreGroupGeometry
from pipeline.store import STORE_FULL, BlockStatus, KeyOutcome

__all__ = ["BlockTask", "Job", "JobTracker", "StorePressure"]


@dataclasses.dataclass(slots=True, eq=False)
class BlockTask:
    """One engine block to move: where it lives in the engine and its key in the store."""

    job: Job
    store_group: int
    block_index: int
    block_id: int
    key: str = ""

    @property
    def geometry(self) -> StoreGroupGeometry:
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

    @property
    def is_load(self) -> bool:
        return isinstance(self.message, Load)

    def report(self, task: BlockTask, outcome: KeyOutcome) -> BlockReport:
        kv_group_id = self.session.store_groups[task.store_group].kv_group_id
        return BlockReport(
            kv_group_id, task.block_index, task.block_id, outcome.status, outcome.reason
        )


class JobTracker:
    """Counts each job's unsettled blocks and completes it when none are left."""

    def __init__(
        self,
        completions: ObjectSendStream[Job],
        load_completions: ObjectSendStream[Job] | None = None,
    ) -> None:
        """Finished jobs go to ``completions``; loads to ``load_completions`` if given, so
        that a load's reply never queues behind a backlog of save replies."""
        self._completions = completions
        self._load_completions = load_completions or completions
        self._open: set[Job] = set()
        self._loads = 0  # accepted, not yet finished
        self._no_loads = anyio.Event()
        self._no_loads.set()

    @property
    def open_jobs(self) -> int:
        return len(self._open)

    def accept(self, job: Job) -> None:
        self._open.add(job)
        job.session.job_started(save=not job.is_load)
        if job.is_load:
            if not self._loads:
                self._no_loads = anyio.Event()
            self._loads += 1

    async def yield_to_loads(self, limit_s: float) -> None:
        """Wait while loads are in flight, for at most ``limit_s``: saves go second."""
        if self._loads and limit_s > 0:
            with anyio.move_on_after(limit_s):
                await self._no_loads.wait()

    def answered(self, job: Job) -> None:
        """The engine has its reply (or cannot get one): forget the job."""
        if job in self._open:
            self._open.remove(job)
            job.session.job_finished(save=not job.is_load)

    def plan(self, job: Job, tasks: list[BlockTask]) -> None:
        """Set the blocks a job will settle (called once, by the group filter)."""
        job.planned = tasks
        job.pending = len(tasks)

    async def settle(self, job: Job, outcomes: Iterable[tuple[BlockTask, KeyOutcome]]) -> None:
        for task, outcome in outcomes:
            job.reports.append(job.report(task, outcome))
            job.pending -= 1
        if job.pending == 0:
            await self._finish(job)

    async def settle_all(self, tasks: Iterable[BlockTask], outcome: KeyOutcome) -> None:
        """Settle tasks, possibly of several jobs, with one outcome."""
        by_job: dict[Job, list[BlockTask]] = {}
        for task in tasks:
            by_job.setdefault(task.job, []).append(task)
        for job, job_tasks in by_job.items():
            await self.settle(job, ((task, outcome) for task in job_tasks))

    async def _finish(self, job: Job) -> None:
        if not job.done:
            job.done = True
            if job.is_load:
                self._load_finished()
            lane = self._load_completions if job.is_load else self._completions
            await lane.send(job)

    def _load_finished(self) -> None:
        self._loads -= 1
        if not self._loads:
            self._no_loads.set()

    def abandon_open(self, reason: str) -> list[Job]:
        """Jobs not yet answered, their unsettled blocks failed with ``reason`` (on abort)."""
        outcome = KeyOutcome(BlockStatus.FAILED, reason)
        jobs = list(self._open)
        for job in jobs:
            settled = {(r.group_id, r.block_index) for r in job.reports}
            job.reports.extend(
                job.report(task, outcome)
                for task in job.planned
                if (task.geometry.kv_group_id, task.block_index) not in settled
            )
            job.pending = 0
            if job.is_load and not job.done:
                self._load_finished()
            job.done = True
        return jobs


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
        self._requests.update(
            self._request(t) for t, o in zip(tasks, outcomes, strict=True) if o == STORE_FULL
        )

    def split(self, tasks: list[BlockTask]) -> tuple[list[BlockTask], list[BlockTask]]:
        """(tasks to skip as store_full, tasks to save)."""
        if not self._requests:
            return [], tasks
        skip = [t for t in tasks if self._request(t) in self._requests]
        return skip, [t for t in tasks if self._request(t) not in self._requests]

