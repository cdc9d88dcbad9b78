"""The receive loop's order, as its admission policy sets it, through the real loop:
loads and lookups go before the saves received ahead of them, at most
``Admission.MAX_HELD`` saves are held back, and every other message keeps its place
behind them.

The socket here is a stand-in holding every frame at once, so that the order is exact;
the real socket is exercised by the service's tests (``test_service.py``: saves, a
lookup and a load queued at a stopped sidecar's socket). Every request comes from an
engine that never registered, so each is answered with an error reply naming its
``seq``, in the order it was dispatched.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import anyio
import pytest

from pipeline.app.dispatch import Receiver
from pipeline.app.metrics import Metrics
from pipeline.core.config import Config
from pipeline.core.messages import (
    EngineMessage,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Load,
    Lookup,
    Save,
    decode_sidecar_message,
    encode,
    pack_tokens,
)
from pipeline.core.tenancy import Peer
from pipeline.runner.edges import Edge, EdgeSendStream, create_edge
from pipeline.state.admission import Admission
from pipeline.state.jobs import Job, JobTracker
from pipeline.state.registry import SessionRegistry

TIMEOUT_S = 5
TOKENS = pack_tokens(range(16))


class QueuedFrames:
    """Frames all waiting at once, as at a socket read after a pause; what is sent back."""

    def __init__(self, messages: Sequence[EngineMessage]) -> None:
        self._frames = collections.deque((b"engine", encode(m)) for m in messages)
        self.replied: list[int] = []
        self.drained = anyio.Event()

    async def receive(self) -> tuple[bytes, Peer, list[bytes]]:
        if not self._frames:
            self.drained.set()
            await anyio.sleep_forever()
        identity, frame = self._frames.popleft()
        return identity, Peer("uid:0"), [frame]

    def waiting(self) -> bool:
        return bool(self._frames)

    def send(self, identity: bytes, frame: bytes) -> bool:
        reply = decode_sidecar_message(frame)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.NOT_REGISTERED
        self.replied.append(reply.seq)
        return True


class Edges:
    """Each path's entrance an edge of its own (nothing is accepted here to reach one)."""

    def __init__(self) -> None:
        self._edges: dict[str, Edge[object]] = {
            path: create_edge(64) for path in ("save", "load", "lookup")}

    def entrance(self, path: str) -> EdgeSendStream[object]:
        return self._edges[path].outbox

    def room(self, path: str) -> int:
        return 64


class NoLane:
    async def send(self, job: Job, /) -> None:
        raise AssertionError("no request of an unregistered engine is accepted")


async def dispatched(messages: Sequence[EngineMessage]) -> list[int]:
    """The ``seq`` of each message, in the order the receive loop answered them."""
    socket = QueuedFrames(messages)
    receiver = Receiver(
        Config(), socket,  # type: ignore[arg-type]
        SessionRegistry(lambda *args: None, max_value_bytes=1 << 20,  # type: ignore[arg-type]
                        save_capacity_blocks=lambda nbytes: 0),
        JobTracker(NoLane()), Metrics(), Edges())
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver.run)
            await socket.drained.wait()
            tg.cancel_scope.cancel()
    return socket.replied


def save(seq: int) -> Save:
    return Save(seq, f"s{seq}", TOKENS, ((1,),))


async def test_a_lookup_and_a_load_behind_saves_go_first_and_a_heartbeat_keeps_its_place(
) -> None:
    replied = await dispatched([save(1), save(2), Lookup(3, TOKENS),
                                Load(4, "l", TOKENS, ((2,),), 16), Heartbeat(5), save(6)])
    assert replied == [3, 4, 1, 2, 5, 6]


@pytest.mark.parametrize("saves", [Admission.MAX_HELD - 1, Admission.MAX_HELD + 4])
async def test_past_max_deferred_saves_the_oldest_goes_before_the_next_frame_is_read(
    saves: int,
) -> None:
    """With more saves queued than may be held back, the oldest are answered one per
    frame read until the load behind them is reached."""
    replied = await dispatched([save(seq) for seq in range(1, saves + 1)]
                               + [Load(saves + 1, "l", TOKENS, ((2,),), 16)])
    before = max(0, saves - Admission.MAX_HELD + 1)
    assert replied == [*range(1, before + 1), saves + 1, *range(before + 1, saves + 1)]
