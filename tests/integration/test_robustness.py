"""Overload, dead engines and hostile frames: the sidecar keeps serving everyone else."""

from __future__ import annotations

import signal
import textwrap
import time
from collections.abc import Iterator

import anyio
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.messages import ErrorReply, decode_sidecar_message
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import (
    KVEngine,
    engine_process,
    hybrid_layout,
    mapped_kv,
    random_tokens,
    shm_names,
)
from transport.client import SaveResult

TIMEOUT = 30


@pytest.fixture(scope="module")
def sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process({"server": {"max_frame_bytes": 64 * 1024}}) as process:
        yield process


async def test_a_flood_of_saves_does_not_starve_another_engines_loads(
    sidecar: SidecarProcess,
) -> None:
    """While engine A floods saves, engine B's lookups and loads all complete correctly,
    and every one of A's saves is answered (stored, present or skipped with a reason)."""
    layout = hybrid_layout(page_bytes=16 * 1024)
    flooder, reader = KVEngine(layout), KVEngine(layout)
    prefix = random_tokens(4 * 16 + 1, seed=77)
    flood_results = []
    credits: list[int] = []
    with anyio.fail_after(90):
        async with await flooder.connect(sidecar.endpoint) as a, \
                await reader.connect(sidecar.endpoint) as b:
            await b.save("seed", prefix, [[1, 2, 3, 4, 5], [6], [1, 2, 3, 4, 5]])

            async def flood(index: int) -> None:
                first = 1 + (index % 15) * 4
                ids = list(range(first, first + 4))
                flood_results.append(await a.save(
                    f"flood-{index}", random_tokens(64, seed=10_000 + index), [ids, [63], ids]))
                credits.append(a.save_credits)

            async with anyio.create_task_group() as tg:
                for index in range(300):
                    tg.start_soon(flood, index)
                for round_ in range(10):
                    assert await b.lookup(prefix) == 64
                    first = 20 + (round_ % 8) * 5
                    ids = [list(range(first, first + 5)), [62], list(range(first, first + 5))]
                    loaded = await b.load(f"load-{round_}", prefix, ids, 64)
                    assert loaded.loaded_tokens == 64 and not loaded.invalid_block_ids
                    assert all(reader.same_block(0, 1 + j, reader, ids[0][j]) for j in range(4))
    assert len(flood_results) == 300
    reasons = {b.reason for r in flood_results for b in r.blocks if b.status == "skipped"}
    assert reasons <= {"overloaded", "staging_full"}
    if "overloaded" in reasons:  # the engine was told to stop pinning blocks for saves
        assert min(credits) == 0
    assert all(r.failed == 0 for r in flood_results)


async def test_saves_the_sidecar_said_it_would_refuse_are_shed_by_the_engine() -> None:
    """Told by a refusal that it has no save credits, while a save of its own still
    awaits its reply, an engine's client answers further saves itself, exactly as the
    sidecar would have (every block skipped, overloaded), and never sends them. With no
    save awaiting a reply, saves go to the sidecar again and are stored."""
    import urllib.request

    engine = KVEngine(hybrid_layout(page_bytes=16 * 1024))
    overrides = {"stages": {"receive": {"max_saves_per_engine": 1}},
                 "faults": {"points": {"stage.transfer": {"delay_ms": 500}}}}
    blocks = [[1, 2, 3, 4], [7], [1, 2, 3, 4]]
    with run_sidecar_process(overrides, metrics=True) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                slow: list[SaveResult] = []
                async with anyio.create_task_group() as tg:
                    async def save_slowly() -> None:
                        slow.append(await client.save("slow", random_tokens(64, seed=1),
                                                      blocks))

                    tg.start_soon(save_slowly)
                    await anyio.sleep(0.2)  # the slow save is in flight
                    refused = await client.save("refused", random_tokens(64, seed=2),
                                                [[5, 6, 8, 9], [7], [5, 6, 8, 9]])
                    assert client.save_credits == 0
                    shed = await client.save("shed", random_tokens(64, seed=3),
                                             [[5, 6, 8, 9], [7], [5, 0, 8, 9]])
                    assert not slow  # the slow save still awaited its reply
                assert client.save_credits > 0
                # Even told there is no room, with no save awaiting a reply the next
                # one is sent: only its reply can say there is room again.
                client.save_credits = 0
                after = await client.save("after", random_tokens(64, seed=4),
                                          [[10, 11, 12, 13], [7], [10, 11, 12, 13]])

        def scrape() -> str:
            assert sidecar.metrics_url is not None
            with urllib.request.urlopen(sidecar.metrics_url, timeout=10) as r:
                return str(r.read().decode())

        text = await anyio.to_thread.run_sync(scrape)
    assert not refused.shed and refused.skipped == 8
    assert {b.reason for b in refused.blocks} == {"overloaded"}
    # As the sidecar answers: stored groups (0 and 2) only, null blocks left out.
    assert shed.shed and (shed.stored, shed.skipped) == (0, 7)
    assert shed.blocks == tuple(
        b for b in refused.blocks if (b.group_id, b.block_index) != (2, 1))
    assert client.saves_shed == 1
    assert slow[0].stored == 8 and after.stored == 8 and not after.shed
    assert 'kvsidecar_requests_total{kind="save"} 3.0' in text  # slow, refused, after


frames = st.one_of(
    st.binary(max_size=512),
    st.builds(
        lambda kind, body: msgspec.msgpack.encode({"kind": kind, **body}),
        st.sampled_from(["register", "heartbeat", "lookup", "save", "load", "unregister",
                         "bogus", ""]),
        st.dictionaries(
            st.sampled_from(["seq", "token_ids", "block_ids", "request_id", "num_tokens",
                             "layout", "tensors", "engine_id", "keys", "self_test", "extra"]),
            st.recursive(
                st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
                | st.binary(max_size=8) | st.booleans(),
                lambda inner: st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                max_leaves=12,
            ),
            max_size=6,
        ),
    ),
)


def test_fuzzed_frames_each_get_an_error_and_the_sidecar_keeps_serving(
    sidecar: SidecarProcess,
) -> None:
    """Thousands of generated frames from an unregistered peer each get exactly one
    error reply; afterwards a real engine registers and saves as usual."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT * 1000)
    socket.connect(sidecar.endpoint)

    @settings(max_examples=2000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frame=frames)
    def one_frame(frame: bytes) -> None:
        socket.send(frame)
        reply = decode_sidecar_message(socket.recv())
        assert isinstance(reply, ErrorReply), reply
        assert reply.code in {"bad_frame", "not_registered", "bad_layout", "bad_version",
                              "hash_mismatch", "bad_tensors"}
        assert reply.message

    try:
        one_frame()
        socket.send(b"x" * (64 * 1024 + 1))
        reply = decode_sidecar_message(socket.recv())
        assert isinstance(reply, ErrorReply) and reply.code == "too_large"
    finally:
        socket.close()
        context.term()

    async def still_serving() -> None:
        engine = KVEngine(hybrid_layout())
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                result = await client.save("after-fuzz", random_tokens(32, seed=5),
                                           [[1, 2], [3], [1, 2]])
        assert result.stored + result.present == 4

    anyio.run(still_serving)


async def test_bad_requests_from_a_registered_engine_get_clear_errors(
    sidecar: SidecarProcess,
) -> None:
    """Out-of-range block ids, wrong group counts and impossible loads are refused by name."""
    from pipeline.core.errors import RequestRejected

    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(48, seed=6)
    cases = [
        ("save", ([[1, 2, 999], [3], [1, 2, 3]],), "out of range"),
        ("save", ([[1, 2, 3], [1, 2, 3]],), "expected block ids for 3"),
        ("load", ([[1, 2, 3], [4], [1, 2, 3]], 100), "exceeds"),
        ("load", ([[1, 2, 3], [4], [1, 2, 3]], 40), "not a multiple"),
        ("load", ([[1, 0, 3], [4], [1, 2, 3]], 48), "gave no block"),
        ("load", ([[1, 1, 3], [4], [1, 2, 3]], 48), "appears twice"),
    ]
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            for kind, args, expected in cases:
                with pytest.raises(RequestRejected) as error:
                    if kind == "save":
                        await client.save("bad", tokens, *args)
                    else:
                        await client.load("bad", tokens, *args)
                assert error.value.code == "bad_request"
                assert expected in str(error.value)
            ok = await client.save("good", tokens, [[1, 2, 3], [4], [1, 2, 3]])
    assert ok.failed == 0


ENGINE_SCRIPT = textwrap.dedent("""
    import sys, anyio
    from tests.kit import KVEngine, hybrid_layout, random_tokens, shm_names

    async def main():
        engine = KVEngine(hybrid_layout(page_bytes=64 * 1024))
        client = await engine.connect(sys.argv[1])
        print("registered", flush=True)
        index = 0
        while True:  # saves until killed
            ids = [[1, 2, 3, 4], [5], [1, 2, 3, 4]]
            await client.save(f"r{index}", random_tokens(64, seed=index), ids)
            index += 1

    anyio.run(main)
""")


@pytest.mark.parametrize(
    ("stop", "heartbeat_timeout_s", "event"),
    [(signal.SIGKILL, 60.0, b"session.owner_exited"), (signal.SIGSTOP, 1.0, b"session.reaped")],
    ids=["killed", "silent"],
)
def test_an_engine_gone_mid_save_is_dropped_and_leaves_no_memory(
    stop: signal.Signals, heartbeat_timeout_s: float, event: bytes
) -> None:
    """An engine SIGKILLed mid-save is dropped as soon as its process is seen dead,
    long before the heartbeat timeout; one stopped (alive, silent) is reaped after it.
    Either way the sidecar unmaps its memory, nothing is left in /dev/shm, and the next
    engine is served normally."""
    names = shm_names()
    overrides = {"server": {"heartbeat_timeout_s": heartbeat_timeout_s}}
    with run_sidecar_process(overrides) as sidecar:
        with engine_process(ENGINE_SCRIPT, sidecar.endpoint) as engine:
            time.sleep(0.5)  # mid-stream
            assert mapped_kv(sidecar.pid), "the engine's tensors should be mapped"
            engine.send_signal(stop)
            deadline = time.monotonic() + 15
            while event not in sidecar.log_path.read_bytes():
                assert time.monotonic() < deadline, sidecar.log()
                time.sleep(0.1)
            while mapped_kv(sidecar.pid):
                assert time.monotonic() < deadline, "mappings not released"
                time.sleep(0.1)
        assert shm_names() <= names

        async def next_engine() -> None:
            other = KVEngine(hybrid_layout())
            with anyio.fail_after(TIMEOUT):
                async with await other.connect(sidecar.endpoint) as client:
                    result = await client.save("next", random_tokens(32, seed=8),
                                               [[1, 2], [3], [1, 2]])
            assert result.failed == 0

        anyio.run(next_engine)
        assert sidecar.terminate() == 0


async def test_engine_sent_block_hashes_are_used_and_checked(sidecar: SidecarProcess) -> None:
    """Engines may send their own block hashes: right ones give the same answers as
    tokens alone; a wrong count or a wrong first hash is refused by name."""
    from pipeline.core.errors import RequestRejected
    from pipeline.core.hashing import block_hashes

    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(3 * 16 + 4, seed=71)
    hashes = block_hashes(tokens, 16, cache_salt="s")
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            saved = await client.save("h", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]],
                                      block_hashes=hashes, cache_salt="s")
            assert saved.stored == 6
            assert await client.lookup(tokens, cache_salt="s") == 48
            assert await client.lookup(tokens, block_hashes=hashes, cache_salt="s") == 48
            for bad, code in ((hashes[:-1], "bad_request"),
                              (block_hashes(tokens, 16), "hash_mismatch")):
                with pytest.raises(RequestRejected) as error:
                    await client.lookup(tokens, block_hashes=bad, cache_salt="s")
                assert error.value.code == code


def test_a_lookup_with_the_engine_hashes_sends_only_its_first_block(
    sidecar: SidecarProcess,
) -> None:
    """With the engine's hashes a lookup carries only the prompt's first hash block and
    the prompt's length (as the client builds it), and hits as the whole prompt does.
    A head without the hashes or asked to be explained, one shorter than the first
    block or longer than the prompt, or a first block that its hash does not name, is
    refused by name; the sidecar goes on serving."""
    from pipeline.core.hashing import block_hashes
    from pipeline.core.messages import (
        HashSelfTest,
        Lookup,
        LookupReply,
        Register,
        Registered,
        encode,
        pack_tokens,
    )
    from transport.client import lookup_message

    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(3 * 16 + 4, seed=73)
    hashes = block_hashes(tokens, 16)

    async def save() -> None:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                saved = await client.save("head", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
                assert saved.stored == 6

    anyio.run(save)
    sent = lookup_message(1, tokens, 16, block_hashes=hashes)
    assert (list(sent.token_ids), sent.prompt_tokens) == (tokens[:16], len(tokens))
    for whole in (lookup_message(1, tokens, 16),
                  lookup_message(1, tokens, 16, block_hashes=hashes, explain=True)):
        assert (list(whole.token_ids), whole.prompt_tokens) == (tokens, None)

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT * 1000)
    socket.connect(sidecar.endpoint)

    def ask(message: object) -> object:
        socket.send(encode(message))  # type: ignore[arg-type]
        return decode_sidecar_message(socket.recv())

    def hit(message: Lookup) -> tuple[int, int]:
        reply = ask(message)
        assert isinstance(reply, LookupReply), reply
        return reply.seq, reply.hit_tokens

    head = pack_tokens(tokens[:16])
    try:
        self_test = tuple(range(1, 33))
        assert isinstance(ask(Register(
            "head-only", hybrid_layout(), (), HashSelfTest(self_test, tuple(
                block_hashes(self_test, 16))), lookup_only=True)), Registered)
        assert hit(sent) == (1, 48)
        assert hit(Lookup(2, pack_tokens(tokens))) == (2, 48)
        for seq, (bad, code) in enumerate((
            (Lookup(3, head, prompt_tokens=len(tokens)), "bad_request"),
            (Lookup(4, head, block_hashes=tuple(hashes), explain=True,
                    prompt_tokens=len(tokens)), "bad_request"),
            (Lookup(5, head[:15], block_hashes=tuple(hashes), prompt_tokens=len(tokens)),
             "bad_request"),
            (Lookup(6, pack_tokens(tokens), block_hashes=tuple(hashes), prompt_tokens=48),
             "bad_request"),
            (Lookup(7, head, block_hashes=tuple(hashes[:2]), prompt_tokens=len(tokens)),
             "bad_request"),
            (Lookup(8, pack_tokens(tokens[16:32]), block_hashes=tuple(hashes),
                    prompt_tokens=len(tokens)), "hash_mismatch"),
        ), start=3):
            reply = ask(bad)
            assert isinstance(reply, ErrorReply) and (reply.code, reply.seq) == (code, seq), reply
        assert hit(lookup_message(9, tokens, 16, block_hashes=hashes)) == (9, 48)
    finally:
        socket.close()
        context.term()


async def test_prometheus_metrics_count_requests_outcomes_and_rejections() -> None:
    """With metrics served, /metrics reports requests, block outcomes, refusals and
    latencies as they happen."""
    import urllib.request

    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(2 * 16 + 1, seed=81)
    with run_sidecar_process(metrics=True) as sidecar:
        url = sidecar.metrics_url
        assert url is not None
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                await client.save("m", tokens, [[1, 2, 3], [4], [1, 2, 3]])
                await client.lookup(tokens)
                with pytest.raises(Exception):  # noqa: B017 - any refusal will do
                    await client.load("bad", tokens, [[1, 2, 3], [4], [1, 2, 3]], 31)

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=10) as r:
                return str(r.read().decode())

        text = await anyio.to_thread.run_sync(scrape)
    assert 'kvsidecar_requests_total{kind="save"} 1.0' in text
    assert 'kvsidecar_blocks_total{path="save",reason="",status="stored"} 4.0' in text
    assert 'kvsidecar_blocks_total{path="save",reason="incomplete_block",status="skipped"} 2.0' \
        in text
    assert 'kvsidecar_rejected_total{code="bad_request"} 1.0' in text
    assert 'kvsidecar_request_seconds_count{kind="lookup"} 1.0' in text
    assert 'kvsidecar_requests_total{kind="register"} 1.0' in text
    assert "kvsidecar_sessions 0.0" in text  # the engine unregistered on close
    assert "kvsidecar_staging_withheld_slots 0.0" in text


async def test_lookups_with_a_request_id_reuse_hashes_and_never_go_stale(
    sidecar: SidecarProcess,
) -> None:
    """A request looked up again (and then loaded) under its id gets the same answers as
    without; the same id with other tokens is hashed afresh, never from the old chain."""
    engine = KVEngine(hybrid_layout())
    tokens = random_tokens(4 * 16 + 2, seed=91)
    other = random_tokens(4 * 16 + 2, seed=92)
    with anyio.fail_after(TIMEOUT):
        async with await engine.connect(sidecar.endpoint) as client:
            await client.save("stored", tokens[:49], [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
            assert [await client.lookup(tokens, request_id="r") for _ in range(3)] == [48] * 3
            loaded = await client.load("r", tokens, [[6, 7, 8, 9, 10], [11],
                                                     [6, 7, 8, 9, 10]], 48)
            assert loaded.loaded_tokens == 48
            assert await client.lookup(other, request_id="r") == 0
            assert await client.lookup(tokens, request_id="r") == 48
    assert all(engine.same_block(0, 1 + j, engine, 6 + j) for j in range(3))


def test_an_engine_not_reading_its_replies_loses_them_and_the_others_are_served() -> None:
    """A peer that sends and never reads fills its queue of replies (small high-water
    marks on both sides): the replies it cannot take are dropped and logged, and the
    sidecar goes on serving the others instead of failing."""
    with run_sidecar_process({"server": {"sndhwm": 2}}) as sidecar:
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 1)
        socket.setsockopt(zmq.RCVBUF, 4096)
        socket.setsockopt(zmq.SNDTIMEO, TIMEOUT * 1000)  # a sidecar stuck reading fails it
        socket.connect(sidecar.endpoint)
        try:
            for _ in range(20000):  # each answered by an error reply it never reads
                socket.send(b"not a message")

            async def still_serving() -> None:
                engine = KVEngine(hybrid_layout())
                with anyio.fail_after(TIMEOUT):
                    async with await engine.connect(sidecar.endpoint) as client:
                        result = await client.save("beside-a-deaf-peer",
                                                   random_tokens(32, seed=6),
                                                   [[1, 2], [3], [1, 2]])
                assert result.stored + result.present == 4

            anyio.run(still_serving)
            assert sidecar.process.poll() is None
            assert '"server.send.dropped"' in sidecar.wait_log(
                lambda log: '"server.send.dropped"' in log)
        finally:
            socket.close()
            context.term()
