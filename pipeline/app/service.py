"""The composition root: backends, a socket, sessions and the stage graph, wired once.

The graph is declared in ``pipeline.app.graph``; requests come in through the
``Receiver``. Shutdown: stop accepting (new requests get a ``shutting_down`` error),
let the stages drain within ``server.drain_timeout_s``, then abort and answer every
job still open with failed blocks. An unexpected stage crash ends the service with an
error.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import Awaitable, Callable

import anyio
import structlog
from anyio.abc import TaskStatus

from pipeline.app import process
from pipeline.app.backends import Backends, open_backends
from pipeline.app.dispatch import Receiver
from pipeline.app.graph import AnswerWhereFinished, Resources, build_graph
from pipeline.app.mapping import (
    map_registered_tensors,
    map_shared_tensors,
    open_handover_desk,
    step_events,
)
from pipeline.app.metrics import BackendGauges, Metrics
from pipeline.backends.cpu_copy import copy_features
from pipeline.backends.cuda_kernels import KernelForms, compile_kernels, kernel_forms
from pipeline.backends.faults import Faults
from pipeline.backends.stores.disk.behind import DISK
from pipeline.core.config import Config
from pipeline.core.errors import InternalFailure, StoreError
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.keys import ValueFormat
from pipeline.core.tenancy import Tenancy
from pipeline.state.events import KVEventLog
from pipeline.state.history import BlockHistory
from pipeline.state.jobs import Failable, JobTracker, Reply, StorePressure, mark_done
from pipeline.state.registry import SessionRegistry
from stages.completion import CompletionStage
from transport.events import EventPublisher
from transport.handover import HandoverDesk
from transport.server import SidecarSocket, hold_endpoint_of, open_server_socket

__all__ = ["Sidecar", "run_sidecar"]


log = structlog.get_logger("kvsidecar.service")

STRAGGLER_WINDOW_S = 0.1
COPY_WAIT_S = 5.0
"""At shutdown, how long copies in flight may take to return before the paths stop."""
OWNER_CHECK_S = 1.0
"""How often the engines whose memory is mapped are checked for having exited."""
KERNEL_COMPILES = 16
"""Registrations whose GPU kernels may wait to be compiled; past them, an engine's first
copies compile its kernels (most engines share theirs: one compile serves them all)."""


class Sidecar:
    """One running sidecar: sessions, the receiver and the stage graph."""

    def __init__(
        self, config: Config, backends: Backends, socket: SidecarSocket, faults: Faults,
        events: KVEventLog, history: BlockHistory, tenancy: Tenancy,
        desk: HandoverDesk | None,
    ) -> None:
        """``desk``: where engines hand their CPU memory over (None: no ipc:// endpoint,
        so no CPU memory is served)."""
        self.config = config
        self.desk = desk
        self._gpu_copies = config.stages.transfer.device == "cuda"
        """The copies run on GPUs: their kernels are compiled as engines register."""
        self._kernels_to_compile, self._kernels_inbox = anyio.create_memory_object_stream[
            set[KernelForms]](KERNEL_COMPILES)
        self.history = history
        self.faults = faults
        self.backends = backends
        self.events = events
        self.publisher = EventPublisher(config.events, events) if events.enabled else None
        pool = backends.pool
        self.registry = SessionRegistry(
            map_shared_tensors if backends.in_place is None
            else functools.partial(map_registered_tensors, backends.in_place),
            checksum=config.store.checksum,
            value_format=ValueFormat(config.store.value_format),
            max_value_bytes=pool.slot_bytes,
            save_capacity_blocks=lambda value_bytes: (
                (pool.slots - pool.load_slots) * (pool.slot_bytes // value_bytes)
            ),
            open_step_event=step_events(config),
            prepare_copies=self._queue_kernels if self._gpu_copies else None,
            limits=config.limits,
            tenancy=tenancy,
        )
        self.graph = build_graph(config)
        answers = AnswerWhereFinished()
        self.tracker = JobTracker(answers, history=history)
        self.metrics = self._metrics()
        self.epoch = secrets.randbits(62) + 1
        """This incarnation's, on every reply (``messages._Reply.epoch``)."""
        self.receiver = Receiver(
            config, socket, self.registry, self.tracker, self.metrics, self.graph,
            faults=faults,
            desk=desk,
            epoch=self.epoch,
        )
        answers.bind(self.tracker, self.receiver.replies.send_reply)
        self.socket = socket

    def _queue_kernels(self, geometries: tuple[StoreGroupGeometry, ...]) -> None:
        """Have the GPU kernels of a newly registered engine's copies compiled (by
        ``_compile_kernels``); while too many registrations wait, its first copies
        compile them. What waits names no engine memory (``KernelForms``)."""
        with contextlib.suppress(anyio.WouldBlock):
            self._kernels_to_compile.send_nowait(kernel_forms(geometries))

    async def _compile_kernels(self) -> None:
        """Compile the kernels each registration queued, in a worker thread, so that no
        compile runs on the event loop while every engine waits
        (``cuda_kernels.compile_kernels``)."""
        async for forms in self._kernels_inbox:
            await anyio.to_thread.run_sync(compile_kernels, forms)

    def _metrics(self) -> Metrics:
        metrics = Metrics()
        pool = self.backends.pool
        metrics.sessions.set_function(lambda: len(self.registry.sessions))
        metrics.open_jobs.set_function(lambda: self.tracker.open_jobs)
        metrics.deadlines_missed.set_function(lambda: self.tracker.deadlines_missed)
        metrics.copies_in_flight.set_function(lambda: self.tracker.copies_in_flight)
        metrics.withheld_slots.set_function(lambda: pool.withheld)
        metrics.events_dropped.set_function(lambda: self.events.dropped)
        save_slots = pool.slots - pool.load_slots
        metrics.watch(
            BackendGauges(
                store_used=self.backends.usage,
                breaker_state=lambda: str(self.backends.breaker.state),
                staging=lambda: (save_slots - pool.free_slots("save"), save_slots,
                                 pool.load_slots - pool.free_slots("load"), pool.load_slots),
                reads_here=self.backends.reads_here,
                disk=self.backends.disk,
            ),
            lambda: self.registry.sessions.values(),
        )
        for path, stage, edge in self.graph.inboxes():
            edge.on_wait(metrics.watch_edge(path, stage, edge.size, edge.queued))
        return metrics

    def _resources(self) -> Resources:
        backends = self.backends
        return Resources(
            config=self.config,
            store=backends.store,
            memory=backends.memory,
            save_copy=backends.save_copy,
            load_copy=backends.load_copy,
            tracker=self.tracker,
            pressure=StorePressure(),
            hash_limiter=anyio.CapacityLimiter(self.config.stages.hashing.workers),
            slot_bytes=backends.pool.slot_bytes,
            events=self.events,
            value_sizes=self.registry.value_sizes,
            moved=self.metrics.mover,
            history=self.history,
            answers_at_once=backends.answers_at_once,
            where=backends.where,
            after_copy=self._fault_point("transfer.copied"),
        )

    async def _fail_item(self, item: Failable, error: StoreError) -> Reply | None:
        """An item that met a store error (or an injected fault, or a bug: counted as
        internal) answers for itself."""
        if isinstance(error, InternalFailure):
            self.metrics.internal.inc()
            log.error("stage.item.internal", item=type(item).__name__, exc_info=error.__cause__)
        else:
            log.info("stage.item.failed", error=str(error), item=type(item).__name__)
        return await item.fail(error, self.tracker)

    def _fault_point(self, point: str) -> Callable[[], Awaitable[None]] | None:
        return functools.partial(self.faults.check, point) if self.faults.enabled else None

    async def _reap_loop(self) -> None:
        """Drop the sessions of engines gone silent, and at once those of engines whose
        process has exited or whose memory shrank under the sidecar, so that none of a
        dead engine's memory stays mapped; and sum up the saves refused meanwhile."""
        timeout = self.config.server.heartbeat_timeout_s
        while True:
            await anyio.sleep(min(timeout / 4, OWNER_CHECK_S))
            self.receiver.replies.log_refusals()
            now = time.monotonic()
            for identity, session in list(self.registry.sessions.items()):
                silent_s = now - session.last_seen
                if session.owner_exited():
                    log.warning("session.owner_exited", engine_id=session.engine_id)
                elif session.memory_lost():
                    log.warning("session.memory_lost", engine_id=session.engine_id,
                                reason="its memory file shrank under the sidecar")
                elif silent_s > timeout:
                    log.warning("session.reaped", engine_id=session.engine_id,
                                silent_s=round(silent_s, 1))
                else:
                    continue
                self.metrics.reaped.inc()
                await self.receiver.stop_jobs(identity, "session_closed")
                self.registry.remove(identity)

    # -- lifecycle --------------------------------------------------------------------

    async def run(
        self, stop: anyio.Event, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until ``stop`` is set, then drain and return."""
        with self.metrics.timing_collections():
            await self._serve(stop, task_status)
        self.registry.close()
        log.info("sidecar.stopped")

    async def _serve(self, stop: anyio.Event, task_status: TaskStatus[str]) -> None:
        receiver = self.receiver
        async with anyio.create_task_group() as root:
            if self.publisher is not None:
                await root.start(self.publisher.run, name="events")
                if self.config.store.backend == "embedded":
                    # The store starts empty but for what its disk tier kept.
                    self.events.cleared()
                    if self.backends.disk is not None:
                        root.start_soon(self.events.announce,
                                        list(self.backends.disk.records), DISK)
            root.start_soon(receiver.run, name="receive")
            if self.desk is not None:
                root.start_soon(self.desk.run, name="handover")
            root.start_soon(self._reap_loop, name="reap")
            if self._gpu_copies:
                root.start_soon(self._compile_kernels, name="kernels")
            drained = anyio.Event()
            pipeline_scope = anyio.CancelScope()

            async def run_pipeline() -> None:
                with pipeline_scope:
                    await self.graph.run(
                        self._resources(), sink=receiver.replies.send_reply,
                        on_failure=self._fail_item, before=self._fault_point,
                        on_done=mark_done,
                    )
                drained.set()

            root.start_soon(run_pipeline, name="pipeline")
            if self.config.metrics.port:
                self.metrics.serve(self.config.metrics.host, self.config.metrics.port)
            task_status.started(self.socket.endpoint)
            log.info("sidecar.ready", endpoint=self.socket.endpoint, copies=copy_features())
            await stop.wait()

            log.info("sidecar.draining", open_jobs=self.tracker.open_jobs)
            receiver.close_inboxes()
            with anyio.move_on_after(self.config.server.drain_timeout_s):
                await drained.wait()
            if not drained.is_set():
                await self._stop_jobs(pipeline_scope)
            await self._answer_stragglers()
            receiver.replies.log_refusals()
            root.cancel_scope.cancel()

    async def _stop_jobs(self, pipeline: anyio.CancelScope) -> None:
        """After a drain that timed out: stop every open job, let the copies in flight
        return (``COPY_WAIT_S`` at most) so that their jobs are answered with what they
        did, then stop the paths and answer the rest as failed. A job whose copy has not
        returned is never answered: only the process's exit proves it stopped."""
        await self.tracker.stop_open("shutdown")
        with anyio.move_on_after(COPY_WAIT_S):
            await self.tracker.copies_done()
        pipeline.cancel()
        abandoned = self.tracker.abandon_open("shutdown")
        log.warning("sidecar.drain.timeout", abandoned=len(abandoned),
                    copies_in_flight=self.tracker.copies_in_flight)
        completion = CompletionStage(self.tracker)
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            for job in abandoned:
                await self.receiver.replies.send_reply(await completion.process(job))

    async def _answer_stragglers(self) -> None:
        """Keep refusing new requests until engines go quiet, so that a request sent just
        before the shutdown gets an answer instead of a timeout."""
        with anyio.move_on_after(STRAGGLER_WINDOW_S * 10):
            while anyio.current_time() - self.receiver.last_receive < STRAGGLER_WINDOW_S:  # noqa: ASYNC110
                await anyio.sleep(STRAGGLER_WINDOW_S / 5)


async def run_sidecar(
    config: Config,
    stop: anyio.Event,
    *,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Open the backends and the socket, serve until ``stop``, drain, close everything."""
    process.for_serving()
    faults = Faults(config.faults)
    events = KVEventLog(config.events)
    history = BlockHistory(config.explain.max_blocks)

    tenancy = Tenancy(config.tenants, config.server.operators,
                      insecure=config.server.allow_insecure_tcp)
    # The endpoint's lock first and last: while it is held, no other sidecar binds the
    # endpoint, and engines know this one may still touch their memory.
    with hold_endpoint_of(config.server):
        async with open_backends(config, faults, on_evicted=history.evicted,
                                 on_moved=events.moved) as backends:
            with open_server_socket(config.server, tenancy) as socket, open_handover_desk(
                    socket, config.server) as desk:
                sidecar = Sidecar(config, backends, socket, faults, events, history,
                                  tenancy, desk)
                await sidecar.run(stop, task_status=task_status)
