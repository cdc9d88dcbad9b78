"""KV events from a live sidecar, read with vLLM 0.33's own ``KVEventBatch`` decoder.

A subscriber joins the PUB socket, catches up through the replay ROUTER (as vLLM's
example subscriber does on a gap in the sequence numbers) and sees every store,
eviction and clear the sidecar made, byte-identical to what vLLM's encoder makes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from pipeline.core.hashing import block_hashes
from pipeline.core.runs import value_span
from pipeline.testing import run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens

kv_events = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.asyncio
TIMEOUT = 30
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)


class Subscriber:
    """vLLM's example subscriber: SUB for live batches, a replay request on a gap."""

    def __init__(self, endpoint: str, replay: str, topic: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.batches: dict[int, Any] = {}
        self.payloads: dict[int, bytes] = {}
        self.topic = topic.encode()

    def close(self) -> None:
        self.context.destroy(linger=0)

    def catch_up(self, start: int) -> int:
        """Ask the replay socket for every batch from ``start``; how many came."""
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        count = 0
        while True:
            assert self.replay.poll(TIMEOUT * 1000), "no replay answer"
            empty, topic, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return count
            assert topic == self.topic
            self._take(int.from_bytes(seq, "big"), payload)
            count += 1

    def receive(self, *, drop: frozenset[int] = frozenset()) -> int:
        """Read the live batches queued now; seqs in ``drop`` are lost on purpose, and a
        gap is filled from the replay socket. How many batches were replayed."""
        replayed = 0
        while self.sub.poll(500):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq in drop:
                continue
            last = max(self.batches, default=-1)
            if seq > last + 1:
                replayed += self.catch_up(last + 1)
            self._take(seq, payload)
        return replayed

    def _take(self, seq: int, payload: bytes) -> None:
        self.batches[seq] = DECODER.decode(payload)
        self.payloads[seq] = payload

    def events(self) -> list[Any]:
        assert sorted(self.batches) == list(range(len(self.batches))), "a gap remained"
        return [event for seq in sorted(self.batches) for event in self.batches[seq].events]


@pytest.fixture
def sockets() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="kvsidecar-events-") as tmp:
        yield f"ipc://{Path(tmp) / 'events'}", f"ipc://{Path(tmp) / 'replay'}"


async def test_stores_evictions_and_the_clear_arrive_as_vllm_events(
    sockets: tuple[str, str],
) -> None:
    """The sidecar starts empty (AllBlocksCleared), each stored block is one BlockStored
    with its store group index, block size, parent and vLLM's int hash, token ids as
    configured; blocks evicted by the embedded LRU come back as BlockRemoved. A lost
    batch is replayed, and every payload is exactly what vLLM's encoder makes of it."""
    endpoint, replay = sockets
    layout = hybrid_layout(page_bytes=4096)
    value_bytes = 2 * 4096 + 8  # two layers per group, and the checksum
    overrides = {  # room for 7 values, each padded to a cache line in the arena
        "events": {"endpoint": endpoint, "replay_endpoint": replay, "include_token_ids": True},
        "store": {"embedded": {"capacity_bytes": 7 * value_span(value_bytes)}},
    }
    engine = KVEngine(layout)
    first, second = random_tokens(4 * 16 + 3, seed=1), random_tokens(4 * 16 + 3, seed=2)
    subscriber = Subscriber(endpoint, replay, "kvsidecar")
    try:
        with run_sidecar_process(overrides) as sidecar:
            with anyio.fail_after(TIMEOUT):
                assert subscriber.catch_up(0) == 1  # joined late: the clear is replayed
                async with await engine.connect(sidecar.endpoint) as client:
                    saved = await client.save("a", first, [[1, 2, 3, 4], [5], [0, 0, 0, 4]])
                    await anyio.sleep(0.2)
                    subscriber.receive()
                    lost = max(subscriber.batches) + 1
                    evicting = await client.save("b", second, [[6, 7, 8, 9], [10], [0, 0, 0, 9]])
                    await anyio.sleep(0.2)
                    replayed = subscriber.receive(drop=frozenset({lost}))
                    await client.save("c", random_tokens(17, seed=3), [[11], [12], [11]])
                    await anyio.sleep(0.2)
                    replayed += subscriber.receive()
    finally:
        subscriber.close()
    assert saved.stored == 5 and evicting.stored == 5
    assert replayed >= 1 and lost in subscriber.batches
    events = subscriber.events()
    assert isinstance(events[0], kv_events.AllBlocksCleared)
    fine = block_hashes(first, 16)
    as_int = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in fine]
    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    full = [e for e in stored[:5] if e.group_idx == 0]
    assert [e.block_hashes for e in full] == [[h] for h in as_int]
    assert [e.parent_block_hash for e in full] == [None, *as_int[:3]]
    assert [e.token_ids for e in full] == [first[16 * j : 16 * (j + 1)] for j in range(4)]
    assert all(e.block_size == 16 and e.medium == "cpu" and e.kv_cache_spec_kind
               == "full_attention" for e in full)
    [state] = [e for e in stored[:5] if e.group_idx == 1]  # mamba: store group 1, not 2
    assert state.block_hashes == [as_int[3]] and state.kv_cache_spec_kind == "mamba"
    removed = [h for e in events if isinstance(e, kv_events.BlockRemoved)
               for h in e.block_hashes]
    assert len(removed) == 5 and set(removed) == set(as_int)  # LRU: the first request
    encoder = msgspec.msgpack.Encoder()
    for seq, batch in subscriber.batches.items():
        assert encoder.encode(batch) == subscriber.payloads[seq]
