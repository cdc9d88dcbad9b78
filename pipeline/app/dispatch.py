"""The receive side: frames in, decoded and checked (``request_checks``), handed to their
path; replies go out through ``replies``.

Admission is one policy (``pipeline.state.admission.Admission``): loads and lookups go as
they are read, a save read while other frames wait is held behind them, and under
overload a save is answered at once (every block skipped) instead of waiting for room.
A request taken is sent into its path (``Graph.entrance``): the receive loop itself runs
the stages that do not wait for it, and hands it to the first that does.

One guard surrounds every message (``Receiver._answer``): whatever its handling raises,
its sender is answered (an error reply, or for an accepted save or load its completion
with every block failed), the failure is logged and counted as ``internal``, and the
loop reads on. A peer's frame never ends the sidecar.

A ``Cancel`` is answered (``Cancelled``) once its request can no longer touch the
engine's memory: at once if no such request is open, else after its completion."""

from __future__ import annotations

import math
import time
from typing import Protocol

import anyio
import structlog

from pipeline.app.metrics import Metrics
from pipeline.app.replies import Replies, Rooms, failed_completion
from pipeline.app.request_checks import check_engine_hashes, check_prompt_head, check_request
from pipeline.backends.faults import Faults
from pipeline.core.config import Config
from pipeline.core.errors import LimitExceeded, ProtocolError, RequestRejected
from pipeline.core.messages import (
    MAX_TEXT,
    Cancel,
    Cancelled,
    EngineMessage,
    ErrorCode,
    Explain,
    Handover,
    HandoverTicket,
    Heartbeat,
    HeartbeatAck,
    Load,
    Lookup,
    Register,
    Save,
    Unregister,
    Unregistered,
    decode_engine_message,
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


class Paths(Rooms, Protocol):
    """Where requests go (``pipeline.runner.Graph``)."""

    def entrance(self, path: str, /) -> Entrance: ...


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
        self.replies = Replies(config, socket, metrics, self.admission, paths, epoch)
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

    async def _cancel(self, identity: bytes, message: Cancel) -> None:
        """Stop the connection's open request ``message.request_seq``; answered once it
        can no longer touch the engine's memory (after its completion, if it was open)."""
        job = self._tracker.find(identity, message.request_seq)
        self._metrics.cancels.labels("open" if job else "not_open").inc()
        if job is None:
            self.replies.send(identity, Cancelled(message.seq, message.request_seq))
            return
        job.cancels.append(message.seq)
        await self._tracker.stop(job, CANCELLED)

    async def stop_jobs(self, identity: bytes, reason: str) -> None:
        """Stop the open jobs of a connection whose session ends (``JobTracker.stop``)."""
        for job in self._tracker.open_of(identity):
            await self._tracker.stop(job, reason)

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
                self.replies.send_error(identity, exc.code, str(exc))
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
            self.replies.send_error(identity, exc.code, exc.detail, _seq(message))
        except _Answered as exc:
            self._internal(identity, message, exc.__cause__)
        except Exception as exc:
            self._internal(identity, message, exc)
            self.replies.send_error(identity, ErrorCode.INTERNAL,
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
                await self.replies.send_reply(Reply(job.session, failed_completion(job), job))
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
            self.replies.send(identity, HandoverTicket(message.seq, token, str(self._desk.path)))
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
            self.replies.send(identity, HeartbeatAck(message.seq))
        elif isinstance(message, Unregister):
            await self.stop_jobs(identity, "unregistered")
            self._registry.remove(identity)
            log.info("session.unregistered", engine_id=session.engine_id)
            self.replies.send(identity, Unregistered(message.seq))
        elif not self.accepting:
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        elif isinstance(message, Lookup):
            self._check_tokens(prompt_length(message), session)
            check_prompt_head(session, message)
            check_engine_hashes(session, message)
            await self._lookup(LookupRequest(session, message, received_at))
        else:
            self._check_tokens(len(message.token_ids), session)
            check_request(session, message, self._config.limits)
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
        self.replies.send(identity, registered)

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
            check_engine_hashes(session, lookup)
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
                self.replies.answer_cancels(item)
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
            await self.replies.send_reply(Reply(job.session, completion_message(job), job),
                                         line=False)
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
