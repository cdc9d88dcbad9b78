"""FastSocket: frames sent and received the non-blocking way first, over real ZMQ sockets."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from transport.sockets import FastSocket

TIMEOUT_S = 20.0


def pair(tmp_path: Path, context: zmq.asyncio.Context, clients: int,
         sndhwm: int = 1000) -> tuple[zmq.asyncio.Socket, list[zmq.asyncio.Socket]]:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, sndhwm)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    endpoint = f"ipc://{tmp_path / 'fast.sock'}"
    router.bind(endpoint)
    dealers = []
    for _ in range(clients):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, sndhwm)
        dealer.connect(endpoint)
        dealers.append(dealer)
    return router, dealers


def close(context: zmq.asyncio.Context, sockets: list[zmq.asyncio.Socket],
          *watched: FastSocket) -> None:
    """Stop watching the sockets' descriptors, then close the sockets and the context."""
    for fast in watched:
        fast.close()
    for socket in sockets:
        socket.close(0)
    context.term()


async def test_requests_from_several_peers_are_all_answered_in_order(tmp_path: Path) -> None:
    """Echoing over FastSocket while peers keep several requests in flight: every reply
    arrives, in each peer's order. (Without re-checking the socket's events after a
    non-blocking call, a receive waiting on the event loop misses its wake-up: this run
    then stalls about one time in three, and the deadline fails it.)"""
    context = zmq.asyncio.Context()
    router, dealers = pair(tmp_path, context, clients=4)
    server = FastSocket(router)
    requests = 1000

    async def echo() -> None:
        for _ in range(requests * len(dealers)):
            identity, frame = await server.recv_multipart()
            await server.send_multipart([identity, frame])

    async def client(dealer: zmq.asyncio.Socket, name: bytes) -> list[bytes]:
        fast = FastSocket(dealer)
        replies: list[bytes] = []
        in_flight = anyio.Semaphore(8)

        async def read() -> None:
            for _ in range(requests):
                replies.append((await fast.recv_multipart())[0])
                in_flight.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for i in range(requests):
                await in_flight.acquire()
                await fast.send_multipart([name + b"-%d" % i])
        return replies

    results: dict[bytes, list[bytes]] = {}
    try:
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(echo)
                for index, dealer in enumerate(dealers):
                    name = b"c%d" % index

                    async def run(dealer: zmq.asyncio.Socket = dealer, name: bytes = name) -> None:
                        results[name] = await client(dealer, name)

                    tg.start_soon(run)
    finally:
        for socket in (router, *dealers):
            socket.close(0)
        context.term()
    for name, replies in results.items():
        assert replies == [name + b"-%d" % i for i in range(requests)]


async def test_a_send_past_the_high_water_mark_waits_and_keeps_the_order(
    tmp_path: Path,
) -> None:
    """With the peer not reading, sends past the high-water mark wait on the event loop
    instead of failing, later sends queue behind them, and once the peer reads, every
    frame arrives in the order it was sent."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 4)
    endpoint = f"ipc://{tmp_path / 'hwm.sock'}"
    router.bind(endpoint)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 4)
    dealer.connect(endpoint)
    receiver, sender = FastSocket(router), FastSocket(dealer)
    # Large enough that the kernel's socket buffers fill too, not only ZMQ's queues.
    frames = [bytes([i]) * (64 << 10) for i in range(200)]
    sent = 0

    async def send_all() -> None:
        nonlocal sent
        for frame in frames:
            await sender.send_multipart([frame])
            sent += 1

    try:
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all)
                await anyio.sleep(0.2)  # the peer is not reading: the sender must stall
                stalled_at = sent
                received = [(await receiver.recv_multipart())[1] for _ in frames]
    finally:
        for socket in (router, dealer):
            socket.close(0)
        context.term()
    assert stalled_at < len(frames)
    assert sent == len(frames)
    assert received == frames


def test_a_socket_waits_on_whichever_event_loop_it_is_used_from(tmp_path: Path) -> None:
    """The descriptor's reader is moved to the event loop a wait runs on: a socket used
    from one loop, then from another, still wakes (the first loop's reader went with
    it, and closing stops the watch)."""
    context = zmq.asyncio.Context()
    router, (dealer,) = pair(tmp_path, context, clients=1)
    server, client = FastSocket(router, fair=True), FastSocket(dealer)

    async def round_trip(payload: bytes) -> bytes:
        async def answer() -> None:
            identity, frame = await server.recv_multipart()  # waits: nothing sent yet
            server.send_now([identity, frame + b"!"])

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer)
                await anyio.wait_all_tasks_blocked()
                await client.send_multipart([payload])
                reply = await client.recv_multipart()
        return reply[0]

    try:
        assert anyio.run(round_trip, b"first") == b"first!"
        assert anyio.run(round_trip, b"second") == b"second!"
    finally:
        close(context, [router, dealer], server, client)


async def test_a_socket_says_whether_a_frame_waits_to_be_received(tmp_path: Path) -> None:
    """``readable`` is True once a frame has arrived and until the last one is taken."""
    context = zmq.asyncio.Context()
    router, (dealer,) = pair(tmp_path, context, clients=1)
    server, client = FastSocket(router, fair=True), FastSocket(dealer)
    try:
        with anyio.fail_after(TIMEOUT_S):
            assert not server.readable()
            await client.send_multipart([b"one"])
            await client.send_multipart([b"two"])
            # On their way through ZMQ's I/O threads, which signal no event to wait on.
            while not server.readable():  # noqa: ASYNC110
                await anyio.sleep(0.001)
            assert (await server.recv_multipart())[1] == b"one"
            while not server.readable():  # noqa: ASYNC110
                await anyio.sleep(0.001)
            assert (await server.recv_multipart())[1] == b"two"
            assert not server.readable()
    finally:
        close(context, [router, dealer], server, client)


async def test_asking_whether_a_frame_waits_wakes_a_receive_waiting_for_it(
    tmp_path: Path,
) -> None:
    """Reading the socket's events takes in the change its descriptor signalled. Asked
    by another task while a receive waits (a copy asks whether it is still alone),
    ``readable`` wakes that receive, which would otherwise wait for a change to come.
    The event loop is held while the frame arrives, so the question comes first."""
    context = zmq.asyncio.Context()
    router, (dealer,) = pair(tmp_path, context, clients=1)
    server = FastSocket(router)
    received: list[list[bytes]] = []
    done = anyio.Event()

    async def receive() -> None:
        received.append(await server.recv_multipart())
        done.set()

    try:
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                await anyio.sleep(0.05)  # the receive waits on the descriptor
                zmq.Socket.shadow(dealer.underlying).send(b"frame")
                while not server.readable():  # the event loop held: no wake-up runs
                    time.sleep(0.001)  # noqa: ASYNC251
                with anyio.fail_after(2):
                    await done.wait()
        assert received[0][1] == b"frame"
    finally:
        close(context, [router, dealer], server)


async def test_a_receive_that_polls_holds_the_event_loop_until_its_frame_or_its_time_is_up(
    tmp_path: Path,
) -> None:
    """``spin_s``: a reply that arrives while the receive polls is taken with the event
    loop held throughout (no other task ran meanwhile); one that arrives after the
    polling time is still received, the receive then waiting on the descriptor and
    letting the others run."""
    context = zmq.asyncio.Context()
    router, (dealer,) = pair(tmp_path, context, clients=1)
    server, client = FastSocket(router), FastSocket(dealer)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.001)

    async def exchange(spin_s: float, reply_after_s: float) -> tuple[bytes, int]:
        """A request, its reply sent from another thread after ``reply_after_s``: the
        reply, and how often the other task ran while the client received it."""
        await client.send_multipart([b"ask"])
        identity, _ = await server.recv_multipart()
        shadow = zmq.Socket.shadow(router.underlying)
        timer = threading.Timer(reply_after_s, shadow.send_multipart, [[identity, b"reply"]])
        timer.start()
        before = ticks
        try:
            frames = await client.recv_multipart(spin_s)
        finally:
            timer.join()
        return frames[0], ticks - before

    try:
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(tick)
                assert await exchange(spin_s=10.0, reply_after_s=0.2) == (b"reply", 0)
                reply, ran = await exchange(spin_s=0.02, reply_after_s=0.3)
                assert reply == b"reply" and ran > 0
                tg.cancel_scope.cancel()
    finally:
        close(context, [router, dealer], server, client)


class _CountedEvents:
    """A socket's calls, passed through, with its reads of ``zmq.EVENTS`` counted."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self._socket = socket
        self.reads = 0

    def get(self, option: int) -> object:
        self.reads += option == zmq.EVENTS
        return self._socket.get(option)

    def __getattr__(self, name: str) -> object:
        return getattr(self._socket, name)


async def test_the_events_are_read_again_only_once_the_descriptor_signals_or_a_call_is_made(
    tmp_path: Path,
) -> None:
    """Asked again and again while nothing arrives, ``readable`` reads the events once;
    a frame that arrives then, or a call made on the socket, has them read again."""
    context = zmq.asyncio.Context()
    router, (dealer,) = pair(tmp_path, context, clients=1)
    server, client = FastSocket(router, fair=True), FastSocket(dealer)

    async def round_trip(payload: bytes) -> None:
        await client.send_multipart([payload])
        identity, frame = await server.recv_multipart()
        server.send_now([identity, frame])
        assert (await client.recv_multipart()) == [payload]

    try:
        with anyio.fail_after(TIMEOUT_S):
            await round_trip(b"connected")  # the connection's own signals are all in
            counted = server._now = _CountedEvents(server._now)  # type: ignore[assignment]
            assert not any(server.readable() for _ in range(100))
            assert counted.reads == 1
            await client.send_multipart([b"one"])
            while not server.readable():  # noqa: ASYNC110
                await anyio.sleep(0.001)
            identity, frame = await server.recv_multipart()
            reads = counted.reads
            assert not server.readable()  # the receive was a call: read again
            assert counted.reads == reads + 1
            server.send_now([identity, frame])
            assert not server.readable()  # so was the send
            assert counted.reads == reads + 2
            assert (await client.recv_multipart()) == [b"one"]
    finally:
        close(context, [router, dealer], server, client)


def test_a_send_that_fails_has_the_events_read_again_too() -> None:
    """A send that raises ``zmq.Again`` (a DEALER with no peer yet) is a call on the
    socket all the same: the events it may have taken in are read again."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    fast = FastSocket(dealer)
    counted = fast._now = _CountedEvents(fast._now)  # type: ignore[assignment]
    try:
        assert not fast.readable() and not fast.readable()
        assert counted.reads == 1
        with pytest.raises(zmq.Again):
            fast.send_now([b"nobody"])
        assert not fast.readable()
        assert counted.reads == 2
    finally:
        dealer.close(0)
        context.term()
