"""The sidecar end to end: a real sidecar process, real ipc:// sockets, real shared memory."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

import anyio
import psutil
import pytest
import torch
import zmq

from pipeline.core.errors import RequestRejected, TransportError
from pipeline.core.hashing import INLINE_TOKENS, block_hashes
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import (
    ErrorReply,
    HashSelfTest,
    Register,
    Registered,
    TensorHandle,
    decode_sidecar_message,
    encode,
)
from pipeline.testing import SidecarProcess, handed_over, run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens
from transport.client import EngineClient
from transport.tensors import Segments, tensor_handle

NUM_BLOCKS = 64
TIMEOUT = 30


@pytest.fixture
def sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process() as process:
        yield process


async def test_engine_b_loads_what_engine_a_saved_byte_exactly(sidecar: SidecarProcess) -> None:
    """Engine A saves a prefix; engine B (same layout) finds and loads it byte for byte,
    while an engine with another layout shares the sidecar."""
    layout = hybrid_layout(block_size=16)
    a, b = KVEngine(layout), KVEngine(layout)
    dense = KVEngine({"model": "other", "groups": [
        {"kind": "full_attention", "block_size": 32, "layers": ["d0"], "page_bytes": 2048}]})
    tokens = random_tokens(4 * 16 + 5)
    with anyio.fail_after(TIMEOUT):
        async with await a.connect(sidecar.endpoint) as ca, \
                await b.connect(sidecar.endpoint) as cb, \
                await dense.connect(sidecar.endpoint) as cd:
            saved = await ca.save("req-a", tokens, [[1, 2, 3, 4, 5], [7], [1, 2, 3, 4, 5]])
            # 4 full blocks in each of the two stored groups; the partial 5th is skipped.
            assert (saved.stored, saved.skipped, saved.failed) == (8, 2, 0)
            dense_tokens = random_tokens(3 * 32, seed=9)
            assert (await cd.save("req-d", dense_tokens, [[1, 2, 3]])).stored == 3
            assert await cd.lookup(dense_tokens) == 2 * 32  # the last token is recomputed

            hit = await cb.lookup(tokens)
            assert hit == 64
            loaded = await cb.load("req-b", tokens, [[11, 12, 13, 14, 15], [9],
                                                    [21, 22, 23, 24, 25]], hit)
    assert loaded.loaded_tokens == 64 and loaded.invalid_block_ids == ()
    for index in range(4):
        assert a.same_block(0, 1 + index, b, 11 + index)
    # Mamba resumes from the state block ending at the hit, and only that one is loaded.
    assert a.same_block(2, 4, b, 24)
    assert not a.same_block(2, 3, b, 23)
    assert {r.block_index for r in loaded.blocks if r.group_id == 2} == {3}


@pytest.mark.parametrize("keys_a, keys_b", [
    ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
    ({"cache_salt": "tenant-a"}, {}),
    ({"lora_name": "adapter", "lora_path": "/adapters/a"}, {}),
    ({"lora_name": "adapter", "lora_path": "/adapters/a"},
     {"lora_name": "adapter", "lora_path": "/adapters/b"}),
])
async def test_other_salt_or_lora_gets_no_hit(
    sidecar: SidecarProcess, keys_a: dict[str, str], keys_b: dict[str, str]
) -> None:
    """Blocks saved under one cache_salt or LoRA are invisible to any other."""
    layout = hybrid_layout()
    engine = KVEngine(layout)
    tokens = random_tokens(3 * 16 + 1, seed=1)
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            await client.save("r", tokens, [[1, 2, 3], [4], [1, 2, 3]], **keys_a)
            assert await client.lookup(tokens, **keys_a) == 48
            assert await client.lookup(tokens, **keys_b) == 0


async def test_saving_stored_blocks_again_reports_present(sidecar: SidecarProcess) -> None:
    """A second save of the same tokens copies nothing and reports every block present."""
    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(2 * 16, seed=2)
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            first = await client.save("r1", tokens, [[1, 2], [3], [1, 2]])
            again = await client.save("r2", tokens, [[5, 6], [7], [5, 6]])
            credits = client.save_credits
    assert (first.stored, first.present) == (4, 0)
    assert (again.stored, again.present, again.skipped, again.failed) == (0, 4, 0, 0)
    assert credits == 32  # nothing in flight: the whole per-engine allowance is free


def _raw_register(endpoint: str, message: Register, fds: Sequence[int]) -> object:
    """The reply to ``message`` sent on a raw DEALER socket, ``fds`` handed over first."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT * 1000)
    try:
        socket.connect(endpoint)
        socket.send(encode(handed_over(socket, message, fds, timeout_s=TIMEOUT)))
        return decode_sidecar_message(socket.recv())
    finally:
        socket.close()
        context.term()


def test_ring_tensors_are_never_mapped(sidecar: SidecarProcess) -> None:
    """Registration succeeds although the ring's handle names a memory file that was never
    handed over: the sidecar never maps (so never reads) a ring tensor."""
    layout = KVCacheLayout.from_dict(hybrid_layout())
    engine = KVEngine(hybrid_layout())
    segments = Segments()
    handles = [tensor_handle(layer, engine.kv_caches[layer], segments)
               for layers in layout.payload_layers for layer in layers]
    ring_handles = [
        TensorHandle(layer=layer, offset=0, shape=(NUM_BLOCKS, 2048), strides=(2048, 1),
                     dtype="bfloat16", segment=len(segments.fds))
        for layer in layout.groups[1].layers
    ]
    tokens = tuple(range(1, 33))
    reply = _raw_register(sidecar.endpoint, Register(
        "raw-engine", layout.to_dict(), (*handles, *ring_handles),
        HashSelfTest(tokens, tuple(block_hashes(tokens, layout.hash_block_size))),
    ), segments.fds)
    assert isinstance(reply, Registered)
    assert reply.store_group_ids == (0, 2)


def test_hash_self_test_mismatch_is_refused(sidecar: SidecarProcess) -> None:
    """An engine whose hashes differ from the sidecar's (other seed) is refused clearly."""
    layout = KVCacheLayout.from_dict(hybrid_layout())
    engine = KVEngine(hybrid_layout())
    segments = Segments()
    handles = tuple(tensor_handle(layer, engine.kv_caches[layer], segments)
                    for layers in layout.payload_layers for layer in layers)
    tokens = tuple(range(1, 33))
    reply = _raw_register(sidecar.endpoint, Register(
        "raw-engine", layout.to_dict(), handles,
        HashSelfTest(tokens, tuple(block_hashes(tokens, 16, seed="other-seed"))),
    ), segments.fds)
    assert isinstance(reply, ErrorReply)
    assert reply.code == "hash_mismatch" and "PYTHONHASHSEED" in reply.message


async def test_saves_report_no_ring_blocks(sidecar: SidecarProcess) -> None:
    """Ring block ids sent with a save never come back as stored blocks."""
    engine = KVEngine(hybrid_layout())
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            result = await client.save("r", random_tokens(32, seed=3), [[1, 2], [3], [1, 2]])
    assert {block.group_id for block in result.blocks} == {0, 2}


async def test_bad_layout_is_refused_with_the_group_named(sidecar: SidecarProcess) -> None:
    """A mamba group outside align mode is refused at registration, naming group and mode."""
    engine = KVEngine(hybrid_layout(mamba_mode="none"))
    with anyio.fail_after(TIMEOUT), pytest.raises(RequestRejected) as error:
        await engine.connect(sidecar.endpoint)
    assert error.value.code == "bad_layout"
    assert "group 2" in str(error.value) and "'none'" in str(error.value)


async def test_many_more_saves_than_staging_holds_stay_bounded() -> None:
    """Saves offered far beyond staging and store capacity all complete, and the
    sidecar's memory stays within its budgets."""
    page = 32 * 1024
    overrides = {
        "staging": {"pool_bytes": 4 * 256 * 1024 * 2, "slot_bytes": 256 * 1024, "load_slots": 1},
        "store": {"embedded": {"capacity_bytes": 4 * 1024 * 1024}},
        "stages": {"group_filter": {"inbox_size": 4}, "batching": {"max_blocks": 4}},
    }
    layout = hybrid_layout(page_bytes=page)
    engine = KVEngine(layout, num_blocks=NUM_BLOCKS)
    requests = 150  # 150 * 8 blocks * 64 KiB = 75 MiB offered
    with run_sidecar_process(overrides) as sidecar:
        process = psutil.Process(sidecar.pid)
        with anyio.fail_after(120):
            async with await engine.connect(sidecar.endpoint) as client:
                await client.save("warm-up", random_tokens(64, seed=99),
                                  [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
                baseline = process.memory_info().rss
                peak = baseline
                results = []

                async def save(index: int) -> None:
                    first = 1 + (index % 15) * 4
                    ids = list(range(first, first + 4))
                    results.append(await client.save(
                        f"r{index}", random_tokens(64, seed=index), [ids, [63], ids]))

                async with anyio.create_task_group() as tg:
                    for index in range(requests):
                        tg.start_soon(save, index)
                    while len(results) < requests:
                        peak = max(peak, process.memory_info().rss)
                        await anyio.sleep(0.01)
    assert len(results) == requests
    for result in results:
        assert result.stored + result.present + result.skipped + result.failed == 8
        assert result.failed == 0
    # Staging (2 MiB) + store arena (4 MiB) + mapped engine pages (~12 MiB) + slack.
    assert peak - baseline < 48 * 1024 * 1024, (baseline, peak)


async def test_loads_and_lookups_received_behind_saves_are_answered_before_them(
    sidecar: SidecarProcess,
) -> None:
    """Saves, then a lookup and a load, all waiting at the socket at once (sent while
    the sidecar was stopped): the lookup and the load are answered before the saves (but
    the first, which may be read before the rest reached the socket), every save with all
    its blocks stored, and the load lands byte for byte."""
    layout = {"model": "m", "groups": [
        {"kind": "full_attention", "block_size": 16, "layers": ["l0", "l1"],
         "page_bytes": 4096}]}
    engine = KVEngine(layout)
    prefix = random_tokens(4 * 16, seed=1)
    answered: list[str] = []
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            assert (await client.save("prefix", prefix, [[1, 2, 3, 4]])).stored == 4

            async def save(index: int) -> None:
                ids = [5 + 4 * index + k for k in range(4)]
                saved = await client.save(f"s{index}", random_tokens(64, seed=10 + index), [ids])
                assert saved.stored == 4
                answered.append(f"save {index}")

            async def lookup() -> None:
                assert await client.lookup(prefix) == 3 * 16  # the last token is recomputed
                answered.append("lookup")

            async def load() -> None:
                loaded = await client.load("load", prefix, [[41, 42, 43, 44]], 3 * 16)
                assert loaded.loaded_tokens == 3 * 16
                answered.append("load")

            os.kill(sidecar.pid, signal.SIGSTOP)
            try:
                async with anyio.create_task_group() as tg:
                    for index in range(8):
                        tg.start_soon(save, index)
                    tg.start_soon(lookup)
                    tg.start_soon(load)
                    await anyio.sleep(0.3)  # every request sent, none read
                    os.kill(sidecar.pid, signal.SIGCONT)
            finally:
                os.kill(sidecar.pid, signal.SIGCONT)
    # The first save may be read before ZMQ's I/O thread, woken with the sidecar, has
    # queued the frames behind it: nothing then waits behind it, and it is served at once.
    # Every later save finds the others waiting and is held back behind the lookup and
    # the load (served in turn, they would come last).
    assert {"lookup", "load"} <= set(answered[:3]), answered
    assert sorted(a for a in answered if a.startswith("save")) == [
        f"save {index}" for index in range(8)]
    for block in range(3):
        assert engine.same_block(0, 1 + block, engine, 41 + block)


async def test_sigterm_mid_stream_answers_every_request_and_exits_zero() -> None:
    """SIGTERM while saves are in flight: every request gets its completion or a
    shutting_down error, and the sidecar exits 0."""
    engine = KVEngine(hybrid_layout(page_bytes=16 * 1024))
    answered: list[str] = []
    with run_sidecar_process({"stages": {"batching": {"deadline_ms": 20.0}}}) as sidecar:
        with anyio.fail_after(60):
            async with await engine.connect(sidecar.endpoint, timeout_s=20) as client:

                async def save(index: int) -> None:
                    first = 1 + (index % 15) * 4
                    ids = list(range(first, first + 4))
                    try:
                        result = await client.save(
                            f"r{index}", random_tokens(64, seed=1000 + index), [ids, [63], ids])
                        assert result.stored + result.present + result.skipped + result.failed == 8
                        answered.append("done")
                    except RequestRejected as exc:
                        assert exc.code == "shutting_down"
                        answered.append("refused")

                async with anyio.create_task_group() as tg:
                    for index in range(60):
                        tg.start_soon(save, index)
                    while not answered:  # noqa: ASYNC110 - polls a list other tasks fill
                        await anyio.sleep(0.001)
                    exit_code = await anyio.to_thread.run_sync(sidecar.terminate)
    assert exit_code == 0, sidecar.log()
    assert len(answered) == 60
    assert "done" in answered


def test_blocking_client_for_engine_threads(sidecar: SidecarProcess) -> None:
    """The blocking wrapper offers the same API to code without an event loop."""
    from transport.client import BlockingEngineClient

    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(2 * 16 + 1, seed=11)
    with BlockingEngineClient(sidecar.endpoint, layout=engine.layout,
                              kv_caches=engine.kv_caches, heartbeat_interval_s=0.05) as client:
        assert client.save("r", tokens, [[1, 2, 3], [4], [1, 2, 3]]).stored == 4
        assert client.lookup(tokens) == 32
        assert client.load("r2", tokens, [[5, 6, 7], [8], [5, 6, 7]], 32).loaded_tokens == 32
    assert engine.same_block(0, 1, engine, 5) and engine.same_block(0, 2, engine, 6)


def test_an_inline_client_looks_up_in_the_calling_thread_and_takes_late_replies(
    sidecar: SidecarProcess,
) -> None:
    """``InlineLookupClient`` (vLLM's scheduler's): a lookup started while the sidecar is
    stopped is not answered within its wait and stays pending; once the sidecar runs
    again, a later ``result`` takes the reply. A cancelled lookup's reply (a miss),
    arriving later, is not taken for another's."""
    from transport.client import BlockingEngineClient, InlineLookupClient

    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(2 * 16 + 1, seed=13)
    other = random_tokens(2 * 16 + 1, seed=14)
    with BlockingEngineClient(sidecar.endpoint, layout=engine.layout,
                              kv_caches=engine.kv_caches) as saver:
        assert saver.save("r", tokens, [[1, 2, 3], [4], [1, 2, 3]]).stored == 4
    with InlineLookupClient(sidecar.endpoint, layout=engine.layout) as client:
        assert client.lookup(tokens) == 32
        os.kill(sidecar.pid, signal.SIGSTOP)
        try:
            pending = client.start_lookup(tokens)
            cancelled = client.start_lookup(other)
            with pytest.raises(FutureTimeout):
                pending.result(timeout=0.2)
            assert not pending.done() and cancelled.cancel()
        finally:
            os.kill(sidecar.pid, signal.SIGCONT)
        assert pending.result(timeout=TIMEOUT) == 32
        assert client.start_lookup(tokens).result(timeout=TIMEOUT) == 32


async def test_an_inline_client_refuses_a_thread_that_runs_an_event_loop(
    sidecar: SidecarProcess,
) -> None:
    """Its loop cannot run inside another: a clear error, not a hang."""
    from transport.client import InlineLookupClient

    with pytest.raises(TransportError, match="runs an event loop"):
        InlineLookupClient(sidecar.endpoint, layout=hybrid_layout())


async def test_kv_first_tensors_round_trip(sidecar: SidecarProcess) -> None:
    """Engines with vLLM's K/V-first tensors [2, num_blocks, ...] share blocks exactly."""
    from transport.tensors import shared_kv_tensor

    layout = {"model": "kvfirst", "groups": [
        {"kind": "full_attention", "block_size": 16, "layers": ["l0", "l1"],
         "page_bytes": 2 * 16 * 4 * 8 * 2}]}

    def tensors() -> dict[str, torch.Tensor]:
        caches = {name: shared_kv_tensor((2, 32, 16, 4, 8), torch.bfloat16)
                  for name in ("l0", "l1")}
        for tensor in caches.values():
            tensor.normal_()
        return caches

    a, b = tensors(), tensors()
    tokens = random_tokens(3 * 16 + 1, seed=12)
    with anyio.fail_after(TIMEOUT):
        async with await EngineClient.connect(sidecar.endpoint, layout=layout, kv_caches=a,
                                              kv_cache_shape="kv_first") as ca, \
                await EngineClient.connect(sidecar.endpoint, layout=layout, kv_caches=b,
                                           kv_cache_shape="kv_first") as cb:
            assert (await ca.save("a", tokens, [[1, 2, 3]])).stored == 3
            loaded = await cb.load("b", tokens, [[7, 8, 9]], await cb.lookup(tokens))
    assert loaded.loaded_tokens == 48
    for name in ("l0", "l1"):
        assert torch.equal(a[name][:, 1:4], b[name][:, 7:10])


async def test_a_sidecar_whose_worker_threads_copied_exits_cleanly() -> None:
    """Saves and loads too large to copy on the event loop run in the copy threads; on
    SIGTERM the sidecar drains and its threads are gone before the interpreter
    finalizes: exit code 0 (a thread still on its way out then aborts the process)."""
    engine = KVEngine(hybrid_layout(page_bytes=256 << 10))  # 512 KiB values
    tokens = random_tokens(4 * 16 + 1, seed=21)
    blocks = [[1, 2, 3, 4], [5], [1, 2, 3, 4]]
    with run_sidecar_process() as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                assert (await client.save("big", tokens, blocks)).stored == 8
                loaded = await client.load("again", tokens, [[9, 10, 11, 12], [13],
                                                             [9, 10, 11, 12]], 64)
        assert loaded.loaded_tokens == 64
        assert sidecar.terminate() == 0, sidecar.log()[-2000:]


async def test_lookups_either_side_of_the_inline_hashing_limit_agree(
    sidecar: SidecarProcess,
) -> None:
    """A prompt short enough to hash on the receive loop (INLINE_TOKENS) and a longer
    one, hashed chunk by chunk on the lookup path, get the hit the stored blocks give,
    from tokens alone, under a request id and with the engine's hashes alike; a block
    changed in the middle bounds both."""
    layout = {"model": "long-prompts", "groups": [{
        "kind": "full_attention", "block_size": 16, "layers": ["attn.0"], "page_bytes": 1024,
    }]}
    blocks = INLINE_TOKENS // 16 + 6
    engine = KVEngine(layout, num_blocks=INLINE_TOKENS // 16 + 16)
    tokens = random_tokens(blocks * 16 + 8, seed=15)  # full blocks, then 8 tokens
    changed = [*tokens[:3200], tokens[3200] + 1, *tokens[3201:]]  # differs in block 200
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            saved = await client.save("long", tokens, [list(range(1, blocks + 1))])
            assert saved.stored == blocks
            for prompt, expected in ((tokens[:INLINE_TOKENS], INLINE_TOKENS - 16),
                                     (tokens, blocks * 16),
                                     (changed[:INLINE_TOKENS], 200 * 16),
                                     (changed, 200 * 16)):
                hashes = block_hashes(prompt, 16)
                assert [await client.lookup(prompt),
                        await client.lookup(prompt, request_id=f"r{len(prompt)}"),
                        await client.lookup(prompt, block_hashes=hashes)] == [expected] * 3


async def test_a_call_gives_up_on_its_own_timeout_while_another_receives(
    sidecar: SidecarProcess,
) -> None:
    """With the sidecar frozen, a call with a short timeout gives up in about that time,
    although a call with a long one is the one receiving. Once the sidecar runs again,
    the long call gets its own answer, the late reply to the short one is dropped, and
    the client goes on."""
    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(2 * 16 + 1, seed=14)
    hits: list[int] = []
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            assert (await client.save("t", tokens, [[1, 2, 3], [4], [1, 2, 3]])).stored == 4

            async def long_call() -> None:
                hits.append(await client.lookup(tokens, timeout_s=TIMEOUT - 5))

            os.kill(sidecar.pid, signal.SIGSTOP)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(long_call)
                    await anyio.sleep(0.2)  # the long call is waiting for its reply
                    started = anyio.current_time()
                    with pytest.raises(TransportError, match="no reply from the sidecar"):
                        await client.lookup(tokens, timeout_s=0.3)
                    waited = anyio.current_time() - started
                    os.kill(sidecar.pid, signal.SIGCONT)
            finally:
                os.kill(sidecar.pid, signal.SIGCONT)
            assert 0.3 <= waited < 5, waited
            assert hits == [32]
            assert await client.lookup(tokens) == 32


async def test_engine_reregisters_with_a_restarted_sidecar() -> None:
    """After the sidecar restarts on the same endpoint, the engine's next requests —
    several at once — re-register by themselves and succeed; the engine is not
    restarted."""
    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(2 * 16 + 1, seed=13)
    with run_sidecar_process() as first:
        endpoint = first.endpoint
        overrides = {"server": {"endpoint": endpoint}}
        with anyio.fail_after(TIMEOUT):
            client = await engine.connect(endpoint, timeout_s=10)
            assert (await client.save("r1", tokens, [[1, 2, 3], [4], [1, 2, 3]])).stored == 4
        assert first.terminate() == 0
        with run_sidecar_process(overrides):
            with anyio.fail_after(TIMEOUT):
                # Several calls find out at once; the engine registers again only once.
                hits: list[int] = []

                async def look() -> None:
                    hits.append(await client.lookup(tokens))

                async with anyio.create_task_group() as tg:
                    for _ in range(5):
                        tg.start_soon(look)
                assert hits == [0] * 5  # the new sidecar's store is empty
                result = await client.save("r2", tokens, [[1, 2, 3], [4], [1, 2, 3]])
                assert result.stored == 4
                assert await client.lookup(tokens) == 32
                await client.aclose()
