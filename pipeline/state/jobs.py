"""The job tracker: every job in flight, the outcomes stages settle into it, and the
answer it gets once.

A job is accepted once and completed exactly once. Stages settle block outcomes into it;
the settle that leaves nothing pending answers it where it finished (``Lane``). On abort
every job still open is completed with failures, so no accepted request goes unanswered.
The items themselves are ``pipeline.state.tasks``'s, re-exported here.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import anyio

from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.outcomes import (
    DEADLINE,
    DISCARDED,
    BlockStatus,
    KeyOutcome,
    failed,
    stopped,
)
from pipeline.state.history import BlockHistory, content_prints
from pipeline.state.tasks import (
    BlockTask,
    Failable,
    Job,
    LookupRequest,
    Reply,
    StagedBatch,
    StorePressure,
    TaskBatch,
    live,
    load_bytes,
    mark_done,
    planned_blocks,
)

__all__ = [
    "BlockTask",
    "Failable",
    "Job",
    "JobTracker",
    "Lane",
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


_JOB = operator.attrgetter("job")


class Lane(Protocol):
    """Where finished jobs go to be answered (``app.graph.AnswerWhereFinished``)."""

    async def send(self, job: Job, /) -> None: ...


class JobTracker:
    """Counts each job's unsettled blocks and completes it when none are left."""

    def __init__(
        self,
        completions: Lane,
        *,
        history: BlockHistory | None = None,
    ) -> None:
        """Finished jobs go to ``completions``. ``history`` hears what came of every
        finished job's blocks once the job is in its lane: after its reply, as the lane
        answers it at once."""
        self._completions = completions
        self._history = history if history is not None and history.enabled else None
        self._open: set[Job] = set()
        self._by_seq: dict[tuple[bytes, int], Job] = {}
        self._loads = 0  # accepted, not yet finished
        self._no_loads = anyio.Event()
        self._no_loads.set()
        self._copying = 0  # (job, batch) copies of engine memory in flight
        self._no_copies = anyio.Event()
        self._no_copies.set()
        self.deadlines_missed = 0
        """Jobs stopped as their deadline passed before a copy of them started."""

    @property
    def open_jobs(self) -> int:
        return len(self._open)

    def is_open(self, job: Job) -> bool:
        """Whether ``job`` was accepted and is not yet answered."""
        return job in self._open

    def find(self, identity: bytes, seq: int) -> Job | None:
        """The open job of request ``seq`` on connection ``identity``, if any."""
        return self._by_seq.get((identity, seq))

    def open_of(self, identity: bytes) -> list[Job]:
        """The open jobs of connection ``identity``."""
        return [job for (owner, _), job in self._by_seq.items() if owner == identity]

    def accept(self, job: Job) -> None:
        self._open.add(job)
        self._by_seq[job.session.identity, job.message.seq] = job
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

    def refuse(self, job: Job, outcome: KeyOutcome) -> None:
        """Answer a save that was never accepted: every block it would move gets
        ``outcome`` (the history hears of it by the request's tokens)."""
        tasks = planned_blocks(job)
        job.reports = [job.report(task, outcome) for task in tasks]
        if self._history is not None and tasks:
            tokens = job.message.token_ids
            first_end = min(_end(task, task.geometry) for task in tasks)
            first = content_prints(tokens, (first_end,))[first_end]
            self._history.refused(first, tokens, outcome, job.message.keys,
                                  job.session.tenant)

    def answered(self, job: Job) -> None:
        """The engine has its reply (or cannot get one): forget the job.

        Its tasks go too: each names its job, so until then the two hold each other, and
        only the cycle collector could free them (a pause for everything in flight)."""
        job.planned = []
        if job in self._open:
            self._open.remove(job)
            self._by_seq.pop((job.session.identity, job.message.seq), None)
            job.session.job_finished(save=not job.is_load)

    def plan(self, job: Job, tasks: list[BlockTask]) -> None:
        """Set the blocks a job will settle (called once, by the group filter, or by
        ``stop`` for a job stopped before it)."""
        if job.done:
            return
        job.planned = tasks
        job.pending = len(tasks)

    async def settle(self, job: Job, outcomes: Sequence[tuple[BlockTask, KeyOutcome]]) -> None:
        """Record what came of some of a job's blocks; the last answers it. A job already
        finished (stopped, abandoned) takes no more."""
        if job.done:
            return
        reports, report = job.reports, job.report
        for task, outcome in outcomes:
            task.outcome = outcome
            reports.append(report(task, outcome))
        job.pending -= len(outcomes)
        if job.stop is not None and job.copying == 0 and job.pending > 0:
            self._settle_rest(job)
        if job.pending == 0:
            await self._finish(job)

    def _settle_rest(self, job: Job) -> None:
        """Settle a stopped job's blocks not yet settled with why it stopped: none is in a
        copy, and those still on their way are dropped where a copy would start."""
        assert job.stop is not None
        outcome, reports, report = job.stop, job.reports, job.report
        for task in job.planned:
            if task.outcome is None:
                task.outcome = outcome
                reports.append(report(task, outcome))
        job.pending = 0

    async def stop(self, job: Job, reason: str) -> None:
        """Stop an open job: no copy of it starts any more, and it is answered (its
        unsettled blocks with ``reason``) as soon as no copy of it is in flight: here, or
        when its last copy returns. A job already stopped keeps its first reason."""
        if job.done:
            return
        if job.stop is None:
            job.stop = stopped(reason, saving=not job.is_load)
        if not job.planned and job.pending == 0:
            self.plan(job, planned_blocks(job))
        if job.copying == 0:
            self._settle_rest(job)
            await self._finish(job)

    def screen(
        self, tasks: Sequence[BlockTask], *, deadline: bool = True
    ) -> tuple[list[BlockTask], list[BlockTask], list[KeyOutcome]]:
        """``enter``'s choice, counting no copy: for a stage to leave out what no copy
        will take before it waits for anything (a staging slot)."""
        passed, out, outcomes = self.enter(tasks, deadline=deadline)
        self.leave(passed)
        return passed, out, outcomes

    def enter(
        self, tasks: Sequence[BlockTask], *, deadline: bool = True
    ) -> tuple[list[BlockTask], list[BlockTask], list[KeyOutcome]]:
        """Admit tasks to a copy of engine memory. Passed: those whose job is neither
        stopped nor answered and (``deadline``) whose deadline has not passed; each of
        their jobs counts one copy in flight until ``leave``. Returned beside them, to be
        settled by the caller: the tasks of stopped jobs (a job past its deadline is
        stopped here) with their outcomes. Tasks of answered jobs are dropped."""
        jobs = set(map(_JOB, tasks))
        now = time.monotonic() if deadline else 0.0
        clear = True
        for job in jobs:
            if job.stop is None and not job.done and deadline and 0 < job.deadline < now:
                job.stop = stopped(DEADLINE, saving=not job.is_load)
                self.deadlines_missed += 1
            clear = clear and not job.done and job.stop is None
        if clear:
            passed = list(tasks)
        else:
            passed, out, outcomes = [], [], []
            for task in tasks:
                job = task.job
                if job.done:
                    continue
                if job.stop is None:
                    passed.append(task)
                else:
                    out.append(task)
                    outcomes.append(job.stop)
            jobs = set(map(_JOB, passed))
        for job in jobs:
            job.copying += 1
        if jobs:
            if not self._copying:
                self._no_copies = anyio.Event()
            self._copying += len(jobs)
        return (passed, [], []) if clear else (passed, out, outcomes)

    def leave(self, tasks: Sequence[BlockTask]) -> None:
        """The copy ``enter`` admitted ``tasks`` to is over."""
        jobs = set(map(_JOB, tasks))
        for job in jobs:
            job.copying -= 1
        self._copying -= len(jobs)
        if not self._copying:
            self._no_copies.set()

    async def finish_stopped(self, tasks: Sequence[BlockTask]) -> None:
        """Answer the jobs of ``tasks`` stopped meanwhile whose last copy has returned
        (called after the batch's own blocks are settled, with what truly came of them)."""
        for job in set(map(_JOB, tasks)):
            if job.stop is not None and job.copying == 0 and not job.done:
                self._settle_rest(job)
                await self._finish(job)

    async def discard(self, tasks: Sequence[BlockTask]) -> None:
        """Settle the tasks of a batch dropped as a job of it was stopped: each stopped
        job's with why it stopped, the others' ``DISCARDED`` (a save's, never stored)
        or failed (a load's, its block not to be read)."""
        await self._settle_by_job(
            (task, task.job.stop or (failed("discarded") if task.job.is_load else DISCARDED))
            for task in tasks)

    async def copies_done(self) -> None:
        """Wait until no copy of engine memory is in flight."""
        await self._no_copies.wait()

    @property
    def copies_in_flight(self) -> int:
        return self._copying

    async def settle_each(
        self, tasks: Sequence[BlockTask], outcomes: Sequence[KeyOutcome]
    ) -> None:
        """Settle tasks, possibly of several jobs, each with its own outcome."""
        await self._settle_by_job(zip(tasks, outcomes, strict=True))

    async def settle_all(self, tasks: Iterable[BlockTask], outcome: KeyOutcome) -> None:
        """Settle tasks, possibly of several jobs, with one outcome."""
        await self._settle_by_job((task, outcome) for task in tasks)

    async def _settle_by_job(self, settled: Iterable[tuple[BlockTask, KeyOutcome]]) -> None:
        """One settle per job, not per block: a batch holds many blocks of few jobs."""
        by_job: dict[Job, list[tuple[BlockTask, KeyOutcome]]] = {}
        for pair in settled:
            by_job.setdefault(pair[0].job, []).append(pair)
        for job, pairs in by_job.items():
            await self.settle(job, pairs)

    async def _finish(self, job: Job) -> None:
        if not job.done:
            job.done = True
            planned = job.planned  # answering the job forgets its blocks
            # ... and may release its closed session's groups: keep them for the history.
            groups = job.session.store_groups
            if job.is_load:
                self._load_finished()
            try:
                await self._completions.send(job)
            finally:
                # After the reply, when the lane answers at once: the engine need not
                # wait for the history (about half of a 16-block save's commit).
                if self._history is not None:
                    _record(self._history, job, planned, groups)

    def _load_finished(self) -> None:
        self._loads -= 1
        if not self._loads:
            self._no_loads.set()

    def abandon_open(self, reason: str) -> list[Job]:
        """Jobs not yet answered and with no copy in flight, their unsettled blocks
        failed with ``reason`` (on abort): to be answered by the caller."""
        return [job for job in list(self._open) if self.abandon(job, reason)]

    async def stop_open(self, reason: str) -> None:
        """Stop every open job (``stop``)."""
        for job in list(self._open):
            await self.stop(job, reason)

    def abandon(self, job: Job, reason: str) -> bool:
        """Fail a job's unsettled blocks with ``reason`` and finish it here, whatever its
        stages still hold (their settles no longer count), for the caller to answer.
        False if it had finished, or if a copy of it is in flight: it is then stopped,
        and answered when that copy returns."""
        if job.done:
            return False
        if job.copying:
            job.stop = job.stop or failed(reason)
            return False
        outcome = KeyOutcome(BlockStatus.FAILED, reason)
        job.reports.extend(
            job.report(task, outcome) for task in job.planned if task.outcome is None
        )
        job.pending = 0
        if job.is_load:
            self._load_finished()
        job.done = True
        return True


def _end(task: BlockTask, geometry: StoreGroupGeometry) -> int:
    """The request's token count at the end of the task's block (``geometry``: its
    store group's)."""
    return (task.block_index + 1) * geometry.group.block_size


def _record(history: BlockHistory, job: Job, planned: list[BlockTask],
            groups: Sequence[StoreGroupGeometry]) -> None:
    """Tell the history what came of each named block of a finished job (every planned
    block is settled by then); ``groups``: its session's store groups as they were
    before it was answered."""
    settled = [(task, task.outcome) for task in planned
               if task.key and task.outcome is not None]
    if job.is_load:
        for task, outcome in settled:
            if outcome.status is BlockStatus.FAILED and "checksum" in outcome.reason:
                history.load_failed(task.key, outcome)
        return
    message = job.message
    ends = [_end(task, groups[task.store_group]) for task, _ in settled]
    prints = content_prints(message.token_ids, ends)
    history.saved(
        ((task.key, groups[task.store_group].keys.own, (task.store_group, task.block_hash), outcome,
          prints[end]) for (task, outcome), end in zip(settled, ends, strict=True)),
        message.keys, job.session.tenant,
    )
