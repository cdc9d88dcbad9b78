"""The KV-event publisher: vLLM 0.33's ``ZmqEventPublisher`` protocol on the sidecar.

- PUB: ``[topic, seq (8 bytes, big-endian), msgpack EventBatch]``, ``seq`` from 0.
- Replay ROUTER: a request ``[id, b"", start_seq (8 bytes)]`` is answered with
  ``[id, b"", topic, seq, payload]`` for every buffered batch from ``start_seq`` on,
  then ``[id, b"", b"", -1 (8 bytes, signed), b""]``.

Both sockets are bound (subscribers connect, as to vLLM's default ``tcp://*:5557``).
Events queued while a batch is sent go out in the next one.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from pipeline.core.config import EventsConfig
from pipeline.core.errors import ConfigError
from pipeline.core.events import EventBatch, KVCacheEvent
from pipeline.state.events import KVEventLog

__all__ = ["END_SEQ", "EventPublisher"]

log = structlog.get_logger("kvsidecar.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH_EVENTS = 1024
PUB_HWM = 100_000


class EventPublisher:
    def __init__(self, config: EventsConfig, events: KVEventLog) -> None:
        self._config = config
        self._events = events
        self._topic = config.topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.replay_buffer
        )
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, then publish every event the log receives, until cancelled."""
        context = zmq.asyncio.Context.instance()
        with contextlib.ExitStack() as stack:
            pub = stack.enter_context(context.socket(zmq.PUB))
            pub.set_hwm(PUB_HWM)
            pub.setsockopt(zmq.LINGER, 0)
            replay = None
            try:
                pub.bind(self._config.endpoint)
                if self._config.replay_endpoint:
                    replay = stack.enter_context(context.socket(zmq.ROUTER))
                    replay.setsockopt(zmq.SNDHWM, 2 * (self._config.replay_buffer + 1))
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.bind(self._config.replay_endpoint)
            except zmq.ZMQError as exc:
                raise ConfigError(
                    f"events: cannot bind {exc} (events.endpoint / events.replay_endpoint)"
                ) from exc
            log.info("events.publishing", endpoint=self._config.endpoint,
                     replay=self._config.replay_endpoint)
            async with anyio.create_task_group() as tg:
                if replay is not None:
                    tg.start_soon(self._serve_replay, replay)
                task_status.started()
                await self._publish(pub)

    async def _publish(self, pub: zmq.asyncio.Socket) -> None:
        pending = self._events.pending
        async for first in pending:
            events: list[KVCacheEvent] = [first]
            while len(events) < MAX_BATCH_EVENTS:
                try:
                    events.append(pending.receive_nowait())
                except anyio.WouldBlock:
                    break
            batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
            seq = next(self._seq)
            payload = self._encoder.encode(batch)
            await pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    async def _serve_replay(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("events.replay.bad_request", frames=len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await replay.send_multipart((client, b"", b"", END_SEQ, b""))
