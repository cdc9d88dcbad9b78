"""The composition root: a store, a socket, the staging pool and the stages, wired once.

    receive ─┬─ save:   group_filter → hashing → dedup → batching → transfer → commit ─┐
             ├─ load:   group_filter → hashing → batching → fetch → scatter ──────────┼→ completion
             └─ lookup: hashing + exists + hit rule → reply                            │
                                                            (every job settles here) ─┘

Shutdown: stop accepting (new requests get a ``shutting_down`` error), let the stages
drain within ``server.drain_timeout_s``, then abort and answer every job still open
with failed blocks. An unexpected stage crash ends the service with an error.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import msgspec
import structlog
import torch
from anyio.abc import TaskGroup, TaskStatus

from pipeline.breaker import CircuitBreakerStore
from pipeline.config import Config, StoreConfig
from pipeline.errors import FrameTooLarge, ProtocolError, RequestRejected, StoreError
from pipeline.faults import Faults, FaultyStore
from pipeline.hitrule import required_blocks
from pipeline.jobs import BlockTask, Job, JobTracker, StorePressure
from pipeline.layout import NULL_BLOCK_ID
from pipeline.messages import (
    EngineMessage,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    Load,
    Lookup,
    LookupReply,
    Register,
    Save,
    SaveDone,
    SidecarMessage,
    TensorHandle,
    Unregister,
    Unregistered,
    decode_engine_message,
    encode,
)
from pipeline.metrics import Metrics
from pipeline.registry import LayerTensors, SessionRegistry
from pipeline.runner import Edge, Process, create_edge, run_batcher, start_stage
from pipeline.sessions import EngineSession
from pipeline.staging import StagingPool
from pipeline.store import BlockStatus, KeyOutcome, KVStore, direct_store, store_error_outcome
from stages.commit import CommitStage
from stages.completion import CompletionStage, completion_message
from stages.dedup import DedupStage
from stages.fetch import FetchStage
from stages.group_filter import GroupFilterStage, plan_tasks
from stages.hashing import HashingStage
from stages.lookup import LookupRequest, LookupStage
from stages.transfer import ScatterStage, StagedBatch, TransferStage, release_values
from transport.server import SidecarSocket, open_server_socket
from transport.tensors import MappedTensors

__all__ = ["Sidecar", "open_store", "run_sidecar"]

log = structlog.get_logger("kvsidecar.service")

STRAGGLER_WINDOW_S = 0.1
OVERLOADED = KeyOutcome(BlockStatus.SKIPPED, "overloaded")


@contextlib.asynccontextmanager
async def open_store(
    config: StoreConfig, faults: Faults | None = None
) -> AsyncIterator[KVStore]:
    """The configured store backend behind a circuit breaker (and fault points, if any),
    closed on exit."""
    store: KVStore
    if config.backend == "mooncake":
        from transport.mooncake_store import open_mooncake_store

        store = await open_mooncake_store(config.mooncake)
    else:
        from transport.embedded_store import EmbeddedStore

        store = EmbeddedStore(config.embedded)
    if faults is not None and faults.enabled:
        store = FaultyStore(store, faults)
    guarded = CircuitBreakerStore(
        store,
        call_timeout_s=config.breaker.call_timeout_s,
        failure_threshold=config.breaker.failure_threshold,
        reset_after_s=config.breaker.reset_after_s,
    )
    try:
        yield guarded
    finally:
        with anyio.CancelScope(shield=True):
            await guarded.aclose()


def map_shared_tensors(
    handles: Sequence[TensorHandle],
) -> tuple[LayerTensors, Callable[[], None]]:
    mapper = MappedTensors()
    try:
        tensors = {
            handle.layer: (mapper.map_tensor(handle), handle.block_dim) for handle in handles
        }
    except BaseException:
        mapper.close()
        raise
    return tensors, mapper.close


class Sidecar:
    """One running sidecar: sessions, the receive loop and the stage graph."""

    def __init__(
        self,
        config: Config,
        store: KVStore,
        socket: SidecarSocket,
        pool: StagingPool,
        faults: Faults | None = None,
    ) -> None:
        self.config = config
        self.faults = faults or Faults(config.faults)
        self.store = store
        self.socket = socket
        self.pool = pool
        self.registry = SessionRegistry(
            map_shared_tensors,
            checksum=config.store.checksum,
            max_value_bytes=pool.slot_bytes,
            save_capacity_blocks=lambda value_bytes: (
                (pool.slots - pool.load_slots) * (pool.slot_bytes // value_bytes)
            ),
        )
        stages = config.stages
        self._completions = create_edge(stages.completion.inbox_size)
        self._load_completions = create_edge(stages.completion.inbox_size)
        self.tracker = JobTracker(self._completions[0], self._load_completions[0])
        self._save_inbox = create_edge(stages.receive.inbox_size)
        self._load_inbox = create_edge(stages.receive.inbox_size)
        self._lookup_inbox = create_edge(stages.lookup.inbox_size)
        self._accepting = True
        self._last_receive = 0.0
        self.metrics = Metrics()
        self.metrics.open_jobs.set_function(lambda: self.tracker.open_jobs)
        self.metrics.withheld_slots.set_function(lambda: self.pool.withheld)

    # -- replies ---------------------------------------------------------------------

    async def reply(self, session: EngineSession, message: SidecarMessage) -> None:
        if isinstance(message, LookupReply | SaveDone):
            message = msgspec.structs.replace(message, save_credits=self._save_credits(session))
        await self._send(session.identity, message)

    def _save_credits(self, session: EngineSession) -> int:
        """How many more saves of this engine would be queued now, not refused."""
        receive = self.config.stages.receive
        if receive.overflow == "block":
            return -1  # saves are never refused, only slowed down
        inbox = self._save_inbox[0].statistics()
        room = inbox.max_buffer_size - inbox.current_buffer_used
        return int(max(0, min(receive.max_saves_per_engine - session.saves_in_flight, room)))

    async def _send(self, identity: bytes, message: SidecarMessage) -> None:
        await self.socket.send(identity, encode(message))

    # -- the stage graph --------------------------------------------------------------

    def _start_stages(self, tg: TaskGroup) -> None:
        config = self.config.stages
        tracker = self.tracker
        hash_limiter = anyio.CapacityLimiter(config.hashing.workers)
        # Loads copy on threads of their own: a load never waits behind a save's copy.
        copy_limiter = anyio.CapacityLimiter(config.transfer.threads)
        load_copy_limiter = anyio.CapacityLimiter(config.transfer.threads)
        group_filter = GroupFilterStage(tracker)
        hashing = HashingStage(tracker, hash_limiter)
        # A store that lends its memory (the embedded one) spares a copy through staging.
        direct = direct_store(self.store)

        def stage(name: str, process: Process, edge_in: Edge, edge_out: Edge | None,
                  workers: int) -> None:
            point = f"stage.{name.split('.')[-1]}"
            start_stage(
                tg, name, process, edge_in[1], edge_out[0] if edge_out else None,
                workers=workers, on_failure=self._fail_item,
                before=functools.partial(self.faults.check, point) if self.faults.enabled
                else None,
            )

        def batch_limit(task: BlockTask) -> int:
            by_bytes = self.pool.slot_bytes // task.geometry.stored_bytes
            return max(1, min(config.batching.max_blocks, by_bytes))

        def batch_group(task: BlockTask) -> tuple[int, int]:
            return id(task.job.session), task.store_group

        for path, inbox in (("save", self._save_inbox), ("load", self._load_inbox)):
            filtered = create_edge(config.group_filter.inbox_size)
            hashed = create_edge(config.hashing.inbox_size)
            to_batch = create_edge(config.dedup.inbox_size) if path == "save" else hashed
            batched = create_edge(config.batching.inbox_size)
            staged = create_edge(config.transfer.inbox_size)
            stage(f"{path}.group_filter", group_filter.process, inbox, filtered,
                  config.group_filter.workers)
            stage(f"{path}.hashing", hashing.process, filtered, hashed, config.hashing.workers)
            if path == "save":
                stage("save.dedup", DedupStage(self.store, tracker).process, hashed, to_batch,
                      config.dedup.workers)
            tg.start_soon(
                functools.partial(
                    run_batcher, to_batch[1], batched[0], group_of=batch_group,
                    limit_of=batch_limit, deadline_s=config.batching.deadline_ms / 1000,
                ),
                name=f"stage.{path}.batching",
            )
            if path == "save":
                pressure = StorePressure()
                transfer = TransferStage(
                    self.pool, tracker, copy_limiter, config.transfer, pressure, direct
                )
                commit = CommitStage(self.store, self.pool, tracker, pressure, direct)
                stage("save.transfer", transfer.process, batched, staged,
                      config.transfer.workers)
                stage("save.commit", commit.process, staged, None, config.commit.workers)
            else:
                fetch = FetchStage(self.store, self.pool, tracker, direct)
                scatter = ScatterStage(self.store, self.pool, tracker, load_copy_limiter, direct)
                stage("load.fetch", fetch.process, batched, staged, config.fetch.workers)
                stage("load.scatter", scatter.process, staged, None, config.scatter.workers)
        lookup = LookupStage(self.store, self.reply, self.metrics.replied)
        stage("lookup", lookup.process, self._lookup_inbox, None, config.lookup.workers)

    async def _fail_item(self, item: object, error: StoreError) -> None:
        """Answer every block of an item that met a store error (or an injected fault)."""
        if isinstance(item, LookupRequest):
            await self.reply(item.session, LookupReply(item.message.seq, 0))
            return
        if isinstance(item, StagedBatch):
            release_values(item, self.pool, direct_store(self.store))
            tasks = item.tasks
        elif isinstance(item, Job):
            if not item.planned and item.pending == 0:
                self.tracker.plan(item, plan_tasks(item))
            tasks = item.planned
            if not tasks:  # nothing to move: the job is answered as it is
                await self.tracker.settle(item, ())
                return
        else:
            tasks = list(item)  # type: ignore[call-overload]
        if not tasks:
            return
        saving = not tasks[0].job.is_load
        log.info("stage.item.failed", error=str(error), blocks=len(tasks))
        await self.tracker.settle_all(tasks, store_error_outcome(error, saving=saving))

    async def _run_completions(self, edge: Edge) -> None:
        completion = CompletionStage(self.reply, self.tracker, self.metrics.replied)
        async with edge[1] as inbox:
            async for job in inbox:
                await completion.process(job)

    # -- receiving --------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            identity, frame = await self.socket.receive()
            self._last_receive = anyio.current_time()
            try:
                message = decode_engine_message(frame, max_bytes=self.config.server.max_frame_bytes)
                await self._dispatch(identity, message)
            except ProtocolError as exc:
                too_large = isinstance(exc, FrameTooLarge)
                code = ErrorCode.TOO_LARGE if too_large else ErrorCode.BAD_FRAME
                self.metrics.rejected.labels(code).inc()
                log.info("server.frame.rejected", code=code, error=str(exc))
                await self._send(identity, ErrorReply(code, str(exc)))
            except RequestRejected as exc:
                self.metrics.rejected.labels(exc.code).inc()
                log.info("server.request.rejected", code=exc.code, error=str(exc))
                await self._send(identity, ErrorReply(exc.code, str(exc), _seq(message)))

    async def _dispatch(self, identity: bytes, message: EngineMessage) -> None:
        self.metrics.requests.labels(message.__struct_config__.tag).inc()
        if isinstance(message, Register):
            registered_session, registered = self.registry.register(identity, message)
            self.metrics.sessions.set(len(self.registry.sessions))
            log.info(
                "session.registered",
                engine_id=registered_session.engine_id,
                store_groups=registered.store_group_ids,
                fingerprint=registered.layout_fingerprint,
            )
            await self._send(identity, registered)
            return
        session = self.registry.get(identity)
        if session is None:
            raise RequestRejected(ErrorCode.NOT_REGISTERED, "register before sending requests")
        session.last_seen = time.monotonic()
        if isinstance(message, Heartbeat):
            await self._send(identity, HeartbeatAck(message.seq))
        elif isinstance(message, Unregister):
            self.registry.remove(identity)
            self.metrics.sessions.set(len(self.registry.sessions))
            log.info("session.unregistered", engine_id=session.engine_id)
            await self._send(identity, Unregistered(message.seq))
        elif not self._accepting:
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        elif isinstance(message, Lookup):
            _check_engine_hashes(session, message)
            await self._enqueue(self._lookup_inbox, LookupRequest(session, message))
        else:
            _check_request(session, message)
            job = Job(session, message)
            if isinstance(message, Load):
                self.tracker.accept(job)
                await self._enqueue(self._load_inbox, job)
            else:
                await self._accept_save(job)

    async def _enqueue(self, inbox: Edge, item: Job | LookupRequest) -> None:
        """Hand a request to its path, waiting for room; if the shutdown closed the path
        meanwhile, the request is refused as shutting down instead."""
        try:
            await inbox[0].send(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            if isinstance(item, Job):
                self.tracker.answered(item)
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down") from exc

    async def _accept_save(self, job: Job) -> None:
        """Queue a save, or under overload answer it at once with every block skipped.

        The refusal is answered right here: it costs no stage, and it never queues in
        front of completions that loads are waiting for."""
        receive = self.config.stages.receive
        if receive.overflow == "block":
            self.tracker.accept(job)
            await self._enqueue(self._save_inbox, job)
            return
        if job.session.saves_in_flight < receive.max_saves_per_engine:
            self.tracker.accept(job)
            try:
                self._save_inbox[0].send_nowait(job)
                return
            except anyio.WouldBlock:
                self.tracker.answered(job)
        job.reports = [job.report(task, OVERLOADED) for task in plan_tasks(job)]
        message = completion_message(job)
        await self.reply(job.session, message)
        self.metrics.replied(message, job.received_at)

    async def _reap_loop(self) -> None:
        timeout = self.config.server.heartbeat_timeout_s
        while True:
            await anyio.sleep(timeout / 4)
            now = time.monotonic()
            for identity, session in list(self.registry.sessions.items()):
                if now - session.last_seen > timeout:
                    log.warning(
                        "session.reaped",
                        engine_id=session.engine_id,
                        silent_s=round(now - session.last_seen, 1),
                    )
                    self.metrics.reaped.inc()
                    self.registry.remove(identity)
                    self.metrics.sessions.set(len(self.registry.sessions))

    # -- lifecycle --------------------------------------------------------------------

    async def run(
        self, stop: anyio.Event, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until ``stop`` is set, then drain and return."""
        async with anyio.create_task_group() as root:
            root.start_soon(self._receive_loop, name="receive")
            root.start_soon(self._reap_loop, name="reap")
            drained = anyio.Event()
            pipeline_scope = anyio.CancelScope()

            async def run_pipeline() -> None:
                with pipeline_scope:
                    async with anyio.create_task_group() as outer:
                        for lane, edge in (("save", self._completions),
                                           ("load", self._load_completions)):
                            outer.start_soon(self._run_completions, edge,
                                             name=f"stage.{lane}.completion")
                        async with anyio.create_task_group() as tg:
                            self._start_stages(tg)
                        # Every stage has drained: no job can settle any more.
                        self._completions[0].close()
                        self._load_completions[0].close()
                drained.set()

            root.start_soon(run_pipeline, name="pipeline")
            if self.config.metrics.port:
                self.metrics.serve(self.config.metrics.host, self.config.metrics.port)
            task_status.started(self.socket.endpoint)
            log.info("sidecar.ready", endpoint=self.socket.endpoint)
            await stop.wait()

            log.info("sidecar.draining", open_jobs=self.tracker.open_jobs)
            self._accepting = False
            for inbox in (self._save_inbox, self._load_inbox, self._lookup_inbox):
                inbox[0].close()
            with anyio.move_on_after(self.config.server.drain_timeout_s):
                await drained.wait()
            if not drained.is_set():
                pipeline_scope.cancel()
                abandoned = self.tracker.abandon_open("shutdown")
                log.warning("sidecar.drain.timeout", abandoned=len(abandoned))
                completion = CompletionStage(self.reply, self.tracker)
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    for job in abandoned:
                        await completion.process(job)
            await self._answer_stragglers()
            root.cancel_scope.cancel()
        self.registry.close()
        log.info("sidecar.stopped")

    async def _answer_stragglers(self) -> None:
        """Keep refusing new requests until engines go quiet, so that a request sent just
        before the shutdown gets an answer instead of a timeout."""
        with anyio.move_on_after(STRAGGLER_WINDOW_S * 10):
            while anyio.current_time() - self._last_receive < STRAGGLER_WINDOW_S:  # noqa: ASYNC110
                await anyio.sleep(STRAGGLER_WINDOW_S / 5)


def _seq(message: object) -> int:
    return int(getattr(message, "seq", 0))


def _check_engine_hashes(session: EngineSession, message: Lookup | Save | Load) -> None:
    """Engine-sent block hashes must match the tokens in number and, on a sample (the
    first block), in value: a wrong hash would name another prefix's KV."""
    if message.block_hashes is None:
        return
    hbs = session.layout.hash_block_size
    expected = len(message.token_ids) // hbs
    if len(message.block_hashes) != expected:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"{len(message.block_hashes)} block hashes for {len(message.token_ids)} tokens; "
            f"expected {expected} (hash_block_size {hbs})",
        )
    if expected and message.block_hashes[0] != session.new_hasher(message.keys).extend(
        message.token_ids[:hbs]
    )[0]:
        raise RequestRejected(
            ErrorCode.HASH_MISMATCH,
            "the first block hash differs from the sidecar's hash of the same tokens",
        )


def _check_request(session: EngineSession, message: Save | Load) -> None:
    """Reject a save or load that cannot be served, before it is accepted."""
    _check_engine_hashes(session, message)
    try:
        projected = session.check_block_ids(message.block_ids)
    except ProtocolError as exc:
        raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from exc
    if not isinstance(message, Load):
        return
    tokens = message.num_tokens
    if tokens > len(message.token_ids):
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"num_tokens {tokens} exceeds the request's {len(message.token_ids)} tokens",
        )
    for geometry, block_ids in zip(session.store_groups, projected, strict=True):
        needed = required_blocks(geometry.group, tokens)
        if needed is None:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"num_tokens {tokens} is not a multiple of kv-cache group "
                f"{geometry.kv_group_id}'s block size {geometry.group.block_size}",
            )
        for block in needed:
            if block >= len(block_ids) or block_ids[block] == NULL_BLOCK_ID:
                raise RequestRejected(
                    ErrorCode.BAD_REQUEST,
                    f"loading {tokens} tokens needs block {block} of kv-cache group "
                    f"{geometry.kv_group_id}, but the engine gave no block for it",
                )
        targets = [block_ids[block] for block in needed]
        if len(set(targets)) != len(targets):
            # Two stored blocks copied into one engine block: whichever lands last wins.
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"loading {tokens} tokens would write block ids {targets} of kv-cache group "
                f"{geometry.kv_group_id}: a block id appears twice",
            )


async def run_sidecar(
    config: Config,
    stop: anyio.Event,
    *,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Open the store and the socket, serve until ``stop``, drain, close everything."""
    # The copy stages split each batch across their own threads (stages.transfer.
    # CopyThreads); an OpenMP team inside every copy call would only add wake-ups.
    torch.set_num_threads(1)
    staging = config.staging
    pool = StagingPool(staging.pool_bytes, staging.slot_bytes, load_slots=staging.load_slots)
    faults = Faults(config.faults)
    async with open_store(config.store, faults) as store:
        await store.register_buffer(pool.buffer)
        with open_server_socket(config.server) as socket:
            sidecar = Sidecar(config, store, socket, pool, faults)
            await sidecar.run(stop, task_status=task_status)
