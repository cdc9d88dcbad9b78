"""The receive side: frames in, decoded and checked, handed to their path; replies out.

Admission is one policy (``pipeline.state.admission.Admission``): loads and lookups go as
they are read, a save read while other frames wait is held behind them, and under
overload a save is answered at once (every block skipped) instead of waiting for room
while the loads behind it wait. Such refusals are logged as one
``saves.refused`` line per engine per second, not a line each: under a flood the lines
would cost the loop more than the refusals.

A request taken is sent into its path (``Graph.entrance``): the receive loop itself
runs the stages that do not wait for it, and hands it to the first that does.

One guard surrounds every message (``Receiver._answer``): whatever its handling raises,
its sender is answered (an error reply, or for an accepted save or load its completion
with every block failed), the failure is logged and counted as ``internal``, and the
loop reads on. A peer's frame never ends the sidecar; ``internal`` is a bug to fix.

A ``Cancel`` is answered (``Cancelled``) once its request can no longer touch the
engine's memory: at once if no such request is open, else after the request's
completion (``JobTracker.stop``). Every reply carries the sidecar's epoch.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Protocol

import anyio
import msgspec
import structlog

from pipeline.app.logs import log_request
from pipeline.app.metrics import Metrics
from pipeline.backends.faults import Faults
from pipeline.core.config import Config, LimitsConfig
from pipeline.core.errors import LimitExceeded, ProtocolError, RequestRejected
from pipeline.core.hitrule import blocks_to_load
from pipeline.core.layout import NULL_BLOCK_ID
from pipeline.core.messages import (
    MAX_TEXT,
    Cancel,
    Cancelled,
    EngineMessage,
    ErrorCode,
    ErrorReply,
    Explain,
    Handover,
    HandoverTicket,
    Heartbeat,
    HeartbeatAck,
    Load,
    LoadDone,
    Lookup,
    LookupReply,
    Register,
    Save,
    SaveDone,
    SidecarMessage,
    Unregister,
    Unregistered,
    decode_engine_message,
    encode,
    outcome_counts,
    prompt_length,
)
from pipeline.core.outcomes import CANCELLED, INTERNAL, OVERLOADED
from pipeline.core.tenancy import Peer
from pipeline.state.admission import Admission, SaveVerdict
from pipeline.state.jobs import (
    Job,
    JobTracker,
    LookupRequest,
    Reply,
    planned_blocks,
)
from pipeline.state.registry import SessionRegistry
from pipeline.state.sessions import EngineSession
from stages.completion import completion_message
from transport.handover import HandoverDesk
from transport.server import SidecarSocket

__all__ = ["Receiver"]

log = structlog.get_logger("kvsidecar.service")

INTERNAL_LOG_INTERVAL_S = 1.0
"""A peer's internal failures are logged once a second at most (the rest are counted)."""



class Paths(Protocol):
    """Where requests go (``pipeline.runner.Graph``)."""

    def entrance(self, path: str, /) -> Entrance: ...

    def room(self, path: str, /) -> int: ...


class Entrance(Protocol):
    async def send(self, item: Job | LookupRequest, /) -> None: ...

    def close(self) -> None: ...


Held = tuple[bytes, Peer, EngineMessage, float]
"""A message held behind a save: its sender, itself and when it was received."""


class Receiver:
    """Reads the socket until cancelled and answers engines."""

    def __init__(
        self,
        config: Config,
        socket: SidecarSocket,
        registry: SessionRegistry,
        tracker: JobTracker,
        metrics: Metrics,
        paths: Paths,
        faults: Faults | None = None,
        desk: HandoverDesk | None = None,
        epoch: int = 0,
    ) -> None:
        """``paths``: where taken requests go. ``desk``: where engines hand CPU memory
        over (None: nowhere). ``epoch``: this incarnation's, stamped on every reply."""
        self._config = config
        self._epoch = epoch
        self._desk = desk
        self._socket = socket
        self._registry = registry
        self._tracker = tracker
        self._metrics = metrics
        self._paths = paths
        receive = config.stages.receive
        self.admission = Admission[Held](shed_saves=receive.overflow == "skip",
                                         save_credits=receive.max_saves_per_engine)
        self._faults = faults if faults is not None and faults.enabled else None
        self.accepting = True
        self.last_receive = 0.0
        self._internal_logged: dict[bytes, tuple[float, int]] = {}
        """Per peer: when its last internal failure was logged, and how many since."""

    def close_inboxes(self) -> None:
        """Stop feeding the paths: they drain what they hold, then end."""
        self.accepting = False
        for path in ("save", "load", "lookup"):
            self._paths.entrance(path).close()

    # -- replies ---------------------------------------------------------------------

    def log_refusals(self) -> None:
        """Log how many saves each engine had refused as overloaded since the last call."""
        for engine_id, count in self.admission.refusals():
            log.info("saves.refused", engine_id=engine_id, saves=count,
                     reason=OVERLOADED.reason)

    async def send_reply(self, reply: Reply, *, line: bool = True) -> None:
        """The sink of every path that answers engines; ``line``: log its request."""
        message = reply.message
        if isinstance(message, LookupReply | SaveDone):
            message = msgspec.structs.replace(
                message, save_credits=self._save_credits(reply.session)
            )
        # Timed as handed to the socket: a send that wakes ZMQ's I/O thread may see this
        # thread preempted by it for a while, as it sends the reply.
        sent_at = time.monotonic()
        self._send(reply.to, message)
        if isinstance(reply.request, Job):
            if 0 < reply.request.deadline < sent_at:
                self._metrics.late.inc()
            if reply.request.cancels:
                self._answer_cancels(reply.request)
        reply = Reply(reply.session, message, reply.request)
        outcomes = outcome_counts(message.blocks) if isinstance(
            message, SaveDone | LoadDone) else collections.Counter()
        self._metrics.replied(reply, outcomes, sent_at)
        if line and self._config.logging.requests:
            log_request(reply, outcomes, sent_at)

    def _save_credits(self, session: EngineSession) -> int:
        """How many more saves of this engine would be taken now (-1: never refused)."""
        return self.admission.credits(saves_in_flight=session.saves_in_flight,
                                      room=self._paths.room("save"))

    def _send(self, identity: bytes, message: SidecarMessage) -> None:
        self._socket.send(identity, encode(msgspec.structs.replace(message, epoch=self._epoch)))

    def _answer_cancels(self, job: Job) -> None:
        """Answer the engine's cancels of ``job``, now answered itself."""
        for seq in job.cancels:
            self._send(job.session.identity, Cancelled(seq, job.message.seq))
        job.cancels.clear()

    async def _cancel(self, identity: bytes, message: Cancel) -> None:
        """Stop the connection's open request ``message.request_seq``; answered once it
        can no longer touch the engine's memory (after its completion, if it was open)."""
        job = self._tracker.find(identity, message.request_seq)
        self._metrics.cancels.labels("open" if job else "not_open").inc()
        if job is None:
            self._send(identity, Cancelled(message.seq, message.request_seq))
            return
        job.cancels.append(message.seq)
        await self._tracker.stop(job, CANCELLED)

    async def stop_jobs(self, identity: bytes, reason: str) -> None:
        """Stop the open jobs of a connection whose session ends (``JobTracker.stop``)."""
        for job in self._tracker.open_of(identity):
            await self._tracker.stop(job, reason)

    def _send_error(self, identity: bytes, code: str, error: str, seq: int = 0) -> None:
        """An error reply; its text cut to what the wire takes."""
        if len(error) > MAX_TEXT:
            error = error[: MAX_TEXT - 3] + "..."
        self._send(identity, ErrorReply(code, error, seq))

    # -- receiving --------------------------------------------------------------------

    async def run(self) -> None:
        admission = self.admission
        while True:
            held = admission.next_held(frames_waiting=self._socket.waiting())
            if held is not None:
                await self._answer(*held)
                continue
            identity, peer, frames = await self._socket.receive()
            received_at = time.monotonic()
            self.last_receive = anyio.current_time()
            try:
                if len(frames) != 1:
                    raise ProtocolError(f"an engine message is one frame, not {len(frames)}")
                message = decode_engine_message(
                    frames[0], max_bytes=self._config.server.max_frame_bytes
                )
            except ProtocolError as exc:
                self._metrics.rejected.labels(exc.code).inc()
                log.info("server.frame.rejected", code=exc.code, error=str(exc)[:MAX_TEXT])
                self._send_error(identity, exc.code, str(exc))
                continue
            if admission.goes_now(is_save=isinstance(message, Save),
                                  is_load_or_lookup=isinstance(message, Load | Lookup),
                                  frames_waiting=self._socket.waiting()):
                await self._answer(identity, peer, message, received_at)
            else:
                admission.hold((identity, peer, message, received_at))

    async def _answer(self, identity: bytes, peer: Peer, message: EngineMessage,
                      received_at: float) -> None:
        """Dispatch a message; a request that cannot be served gets an error reply, and
        one whose handling failed is answered as ``internal`` (the guard)."""
        try:
            await self._dispatch(identity, peer, message, received_at)
        except RequestRejected as exc:
            self._metrics.rejected.labels(exc.code).inc()
            if isinstance(exc, LimitExceeded):
                self._metrics.over_limit.labels(exc.limit).inc()
            log.info("server.request.rejected", code=exc.code, error=str(exc)[:MAX_TEXT])
            self._send_error(identity, exc.code, exc.detail, _seq(message))
        except _Answered as exc:
            self._internal(identity, message, exc.__cause__)
        except Exception as exc:
            self._internal(identity, message, exc)
            self._send_error(identity, ErrorCode.INTERNAL,
                             f"the sidecar failed to handle this {_kind(message)}", _seq(message))

    def _internal(self, identity: bytes, message: EngineMessage,
                  exc: BaseException | None) -> None:
        """Count a message whose handling failed, and log it (once a second per peer)."""
        self._metrics.rejected.labels(ErrorCode.INTERNAL).inc()
        self._metrics.internal.inc()
        now = time.monotonic()
        logged = self._internal_logged
        last, since = logged.get(identity, (-math.inf, 0))
        if now - last < INTERNAL_LOG_INTERVAL_S:
            logged[identity] = (last, since + 1)
            return
        if len(logged) >= 1024:
            logged.clear()
        logged[identity] = (now, 0)
        session = self._registry.sessions.get(identity)
        log.error("server.request.internal", kind=_kind(message), seq=_seq(message),
                  engine_id=None if session is None else session.engine_id,
                  request_id=getattr(message, "request_id", None), unlogged_before=since,
                  exc_info=exc)

    def _injected_bug(self) -> None:
        """Fault point ``receive.accepted``: a save or load failing once accepted."""
        if self._faults is not None:
            self._faults.bug("receive.accepted")

    async def _serve_job(self, job: Job) -> None:
        """Accept and start a save or load; if that fails once it is accepted, it is
        answered at once, every block failed (``_Answered``)."""
        try:
            if isinstance(job.message, Load):
                self._tracker.accept(job)
                self._injected_bug()
                await self._enqueue("load", job)
            else:
                await self._accept_save(job)
        except (RequestRejected, anyio.get_cancelled_exc_class()):
            raise
        except Exception as exc:
            if not self._tracker.is_open(job):
                if job.done:  # answered already: its sender needs nothing more
                    raise _Answered from exc
                raise
            if self._tracker.abandon(job, INTERNAL.reason):
                await self.send_reply(Reply(job.session, _failed_completion(job), job))
            if not job.copying:  # else stopped: answered once its copy returns
                self._tracker.answered(job)
            raise _Answered from exc

    async def _dispatch(self, identity: bytes, peer: Peer, message: EngineMessage,
                        received_at: float) -> None:
        self._metrics.received(str(message.__struct_config__.tag))
        if isinstance(message, Register):
            await self._register(identity, peer, message)
            return
        if isinstance(message, Handover):
            if self._desk is None:
                raise RequestRejected(
                    ErrorCode.BAD_TENSORS, "this sidecar serves no CPU memory: its endpoint "
                    "is not ipc://")
            token = self._desk.issue(identity, peer)
            self._send(identity, HandoverTicket(message.seq, token, str(self._desk.path)))
            return
        if isinstance(message, Explain):
            await self._explain(identity, peer, message)
            return
        if isinstance(message, Cancel):  # the connection's own requests only
            await self._cancel(identity, message)
            return
        session = self._registry.get(identity, peer)
        if session is None:
            raise RequestRejected(ErrorCode.NOT_REGISTERED, "register before sending requests")
        session.last_seen = time.monotonic()
        if isinstance(message, Heartbeat):
            self._send(identity, HeartbeatAck(message.seq))
        elif isinstance(message, Unregister):
            await self.stop_jobs(identity, "unregistered")
            self._registry.remove(identity)
            log.info("session.unregistered", engine_id=session.engine_id)
            self._send(identity, Unregistered(message.seq))
        elif not self.accepting:
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        elif isinstance(message, Lookup):
            self._check_tokens(prompt_length(message), session)
            _check_prompt_head(session, message)
            _check_engine_hashes(session, message)
            await self._lookup(LookupRequest(session, message, received_at))
        else:
            self._check_tokens(len(message.token_ids), session)
            _check_request(session, message, self._config.limits)
            await self._serve_job(Job(session, message, received_at=received_at))

    def _check_tokens(self, tokens: int, session: EngineSession | None) -> None:
        """Refuse a request past ``limits.max_request_tokens``, or past
        ``limits.max_request_blocks`` hash blocks of ``session``'s layout."""
        limits = self._config.limits
        if tokens > limits.max_request_tokens:
            raise LimitExceeded("limits.max_request_tokens",
                                f"a request of {tokens} tokens is longer than this sidecar "
                                f"takes ({limits.max_request_tokens})")
        hbs = 1 if session is None else session.layout.hash_block_size
        if tokens // hbs > limits.max_request_blocks:
            raise LimitExceeded("limits.max_request_blocks",
                                f"a request of {tokens // hbs} hash blocks is more than this "
                                f"sidecar takes ({limits.max_request_blocks})")

    async def _lookup(self, request: LookupRequest) -> None:
        await self._enqueue("lookup", request)

    async def _register(self, identity: bytes, peer: Peer, message: Register) -> None:
        handed = None
        if message.handover:
            if self._desk is None:
                raise RequestRejected(ErrorCode.BAD_TENSORS,
                                      "this sidecar takes no CPU memory handovers")
            handed = self._desk.claim(message.handover, identity, peer)
        session, registered = await self._registry.register(identity, peer, message, handed)
        log.info(
            "session.registered",
            engine_id=session.engine_id,
            identity=peer.principal,
            tenant=session.tenant,
            store_groups=registered.store_group_ids,
            fingerprint=registered.layout_fingerprint,
        )
        self._send(identity, registered)

    async def _explain(self, identity: bytes, peer: Peer, message: Explain) -> None:
        """Explain a prompt as a registered engine of the caller's tenant sees it (any
        engine's, for an operator)."""
        if not self.accepting:
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        session = self._registry.find(message.engine_id, peer)
        self._check_tokens(len(message.token_ids), session)
        hashes = len(message.block_hashes or ())
        if hashes > self._config.limits.max_request_blocks:
            raise LimitExceeded("limits.max_request_blocks",
                                f"an explanation of {hashes} block hashes is more than this "
                                f"sidecar takes ({self._config.limits.max_request_blocks})")
        lookup = Lookup(message.seq, message.token_ids, message.keys, message.block_hashes,
                        explain=True)
        if message.block_hashes is None or len(message.token_ids):
            _check_engine_hashes(session, lookup)
        await self._enqueue("lookup", LookupRequest(session, lookup, reply_to=identity))

    async def _enqueue(self, path: str, item: Job | LookupRequest) -> None:
        """Send a request into its path, waiting for room; if the shutdown closed the path
        meanwhile, the request is refused as shutting down instead (unless the shutdown
        has answered it already)."""
        try:
            await self._paths.entrance(path).send(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            if isinstance(item, Job):
                if item.done:
                    return
                self._tracker.answered(item)
                self._answer_cancels(item)
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down") from exc

    async def _accept_save(self, job: Job) -> None:
        """Take a save, or under overload answer it at once with every block skipped.

        The refusal is answered right here and costs no stage. A save taken whose job
        or batch then finds its stage's inbox full is answered the same way, block by
        block, by the save path (``app.graph.paths``): the receive loop never waits for
        room while shedding."""
        verdict = self.admission.on_save(saves_in_flight=job.session.saves_in_flight,
                                         room=self._paths.room("save"))
        if verdict is SaveVerdict.REFUSE:
            self._tracker.refuse(job, OVERLOADED)
            await self.send_reply(Reply(job.session, completion_message(job), job), line=False)
            self.admission.refused(job.session.engine_id)
            return
        self._tracker.accept(job)
        self._injected_bug()
        await self._enqueue("save", job)


def _seq(message: object) -> int:
    return int(getattr(message, "seq", 0))


def _kind(message: EngineMessage) -> str:
    return str(message.__struct_config__.tag)


class _Answered(Exception):
    """An accepted job whose start failed has been answered; ``__cause__`` is why."""


def _failed_completion(job: Job) -> SaveDone | LoadDone:
    """The completion of a job that failed as a whole: every block it would move failed,
    and for a load nothing loaded past what the engine held (every block it would write
    is listed, so that the engine never reads one)."""
    if job.reports:  # settled in part, the rest failed (``JobTracker.abandon``)
        reports = tuple(job.reports)
    else:
        tasks = job.planned or planned_blocks(job)
        reports = tuple(job.report(task, INTERNAL) for task in tasks)
    message = job.message
    if isinstance(message, Save):
        return SaveDone(message.seq, message.request_id, reports)
    projected = job.session.layout.project_block_ids(message.block_ids)
    invalid = sorted({block for ids in projected for block in ids if block != NULL_BLOCK_ID})
    return LoadDone(message.seq, message.request_id, message.computed_tokens,
                    tuple(invalid), reports)


def _check_engine_hashes(session: EngineSession, message: Lookup | Save | Load) -> None:
    """Engine-sent block hashes must match the tokens in number and, on a sample (the
    first block), in value: a wrong hash would name another prefix's KV."""
    if message.block_hashes is None:
        if session.engine_hashes_only:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                "this engine hashes blocks with an algorithm the sidecar does not compute: "
                "send block_hashes with every request",
            )
        return
    hbs = session.layout.hash_block_size
    tokens = prompt_length(message)
    expected = tokens // hbs
    if len(message.block_hashes) != expected:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"{len(message.block_hashes)} block hashes for {tokens} tokens; "
            f"expected {expected} (hash_block_size {hbs})",
        )
    if session.engine_hashes_only:
        return
    if expected and message.block_hashes[0] != session.first_block_hash(
            message.keys, message.token_ids[:hbs].tobytes()):
        raise RequestRejected(
            ErrorCode.HASH_MISMATCH,
            "the first block hash differs from the sidecar's hash of the same tokens",
        )


def _check_prompt_head(session: EngineSession, message: Lookup) -> None:
    """A lookup sending only the head of its prompt (``prompt_tokens``) must name every
    block by the engine's hash and send at least the first block, which is checked
    against the first hash: the sidecar hashes and explains only tokens it was sent."""
    length = message.prompt_tokens
    if length is None:
        return
    if message.block_hashes is None or message.explain:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            "a lookup sending only its prompt's first block (prompt_tokens) needs the "
            "engine's block_hashes, and cannot be explained",
        )
    head = min(length, session.layout.hash_block_size)
    if not head <= len(message.token_ids) <= length:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"{len(message.token_ids)} tokens sent of a {length}-token prompt; "
            f"expected at least its first {head}",
        )


def _check_block_counts(session: EngineSession, message: Save | Load,
                        limits: LimitsConfig) -> None:
    """Refuse block-id lists longer than a request can use, before anything walks them:
    a save names no more blocks than its tokens reach; a load's lists are bounded by the
    blocks the engine registered (the connector sends every block of its request) and by
    the longest request."""
    longest = min(limits.max_request_tokens,
                  limits.max_request_blocks * session.layout.hash_block_size)
    if len(message.block_ids) != len(session.layout.groups):
        return  # refused by check_block_ids
    stored = {geometry.kv_group_id: geometry for geometry in session.store_groups}
    for group_id, (group, ids) in enumerate(
            zip(session.layout.groups, message.block_ids, strict=True)):
        if isinstance(message, Save):
            most = -(-len(message.token_ids) // group.block_size)
            what = f"a save of {len(message.token_ids)} tokens reaches {most}"
        else:
            most = -(-longest // group.block_size)
            what = f"a request reaches at most {most}"
            if group_id in stored:
                most = min(most, stored[group_id].num_blocks)
                what = f"the engine registered {most}"
        if len(ids) > most:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"{len(ids)} block ids for kv-cache group {group_id}; {what}",
            )


def _check_request(session: EngineSession, message: Save | Load,
                   limits: LimitsConfig) -> None:
    """Reject a save or load that cannot be served, before it is accepted."""
    if session.lookup_only:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST, "this engine registered for lookups only: it cannot save or load"
        )
    _check_block_counts(session, message, limits)
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
        needed = blocks_to_load(geometry.group, tokens, message.computed_tokens)
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
