"""The Mooncake store backend against a real mooncake_master on 127.0.0.1."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import numpy
import psutil
import pytest
import pytest_asyncio
import torch
from anyio.streams.text import TextReceiveStream

from pipeline.backends.in_place_copy import HelperThreads, InPlaceCopyEngine
from pipeline.backends.memory import InPlaceMemory
from pipeline.backends.staging import StagingPool
from pipeline.backends.stores.mooncake.codes import get_outcome, put_outcome
from pipeline.backends.stores.mooncake.master import (
    EmbeddedMaster,
    MasterEndpoints,
    open_embedded_master,
)
from pipeline.backends.stores.mooncake.setup import _prefault, _segment_here, open_mooncake_store
from pipeline.backends.stores.mooncake.store import MooncakeStore
from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.errors import StoreCallAbandoned, StoreError
from pipeline.core.geometry import StoreGroupGeometry, build_store_groups
from pipeline.core.layout import KVCacheLayout
from pipeline.core.outcomes import (
    LOADED,
    MISSING,
    PRESENT,
    STORE_FULL,
    STORED,
    BlockStatus,
    KeyOutcome,
    failed,
)
from pipeline.core.store import KVStore, Pieces, PiecewiseKVStore, Presence, ReadHere, Seal
from tests.kit import StallProxy, stall_proxy

pytestmark = [pytest.mark.mooncake, pytest.mark.asyncio(loop_scope="module")]

MIB = 1024 * 1024
REPO = Path(__file__).resolve().parents[2]
LONG_LEASE_MS = 10_000
"""The read lease a client counts on where no test evicts or removes what it reads:
a load read where it lies then never fails for a slow machine. (The master's own
lease is SMALL's: removal tests wait that long.)"""
SMALL = MooncakeStoreConfig(
    global_segment_bytes=16 * MIB,
    local_buffer_bytes=0,
    kv_lease_ttl_ms=100,
    call_timeout_s=5.0,
    startup_timeout_s=15.0,
    close_timeout_s=5.0,
)


def replace(config: MooncakeStoreConfig, **changes: object) -> MooncakeStoreConfig:
    return msgspec.structs.replace(config, **changes)


def listening(port: int) -> bool:
    """Whether any process listens on the TCP port (asked of the kernel: a connect() test
    can succeed without a listener, when the kernel picks that port as the source)."""
    return any(
        conn.laddr.port == port and conn.status == psutil.CONN_LISTEN
        for conn in psutil.net_connections(kind="tcp")
    )


def gone(process: psutil.Process) -> bool:
    """Exited with every thread. A process whose main thread has exited shows as a zombie
    while its other threads may still run and hold its sockets, so a zombie counts as
    gone only once it is down to that one thread (init reaps it later)."""
    try:
        if process.status() != psutil.STATUS_ZOMBIE:
            return False
        return len(os.listdir(f"/proc/{process.pid}/task")) <= 1
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True


def master_ports(pid: int) -> set[int]:
    return {
        conn.laddr.port
        for conn in psutil.Process(pid).net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN
    }


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def master() -> AsyncIterator[EmbeddedMaster]:
    """One master for the tests that don't need a cluster of their own."""
    with anyio.fail_after(20):
        started = await open_embedded_master(SMALL)
    async with started:
        yield started


def client_config(master: EmbeddedMaster, **changes: object) -> MooncakeStoreConfig:
    return replace(
        SMALL,
        master=master.endpoints.master_address,
        metadata_server=master.endpoints.metadata_server,
        **changes,
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def store(master: EmbeddedMaster) -> AsyncIterator[MooncakeStore]:
    """A client of the shared master; tests keep apart by naming keys after themselves."""
    with anyio.fail_after(20):
        opened = await open_mooncake_store(client_config(master))
    async with opened:
        yield opened


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def staging(store: MooncakeStore) -> torch.Tensor:
    buffer = torch.zeros(4 * MIB, dtype=torch.uint8)
    with anyio.fail_after(5):
        await store.register_buffer(buffer)
    return buffer


async def poll_until(check: Callable[[], Awaitable[object]]) -> None:
    """Poll state held by another process (the master) until ``check`` is truthy."""
    while not await check():  # noqa: ASYNC110 - nothing to wait on but the master's state
        await anyio.sleep(0.05)


def fill_random(view: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=generator))


@pytest.mark.parametrize(
    ("code", "outcome"),
    [(0, STORED), (-705, PRESENT), (-200, STORE_FULL), (-900, failed("mooncake:-900"))],
)
async def test_put_codes_map_to_outcomes(code: int, outcome: KeyOutcome) -> None:
    """Mooncake's put codes: OK stored, exists present, no handle full, others failed."""
    assert put_outcome(code) == outcome


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (4096, LOADED),
        (-704, MISSING),
        (1024, failed("size_mismatch")),
        (-600, failed("mooncake:-600")),  # buffer too small
        (-707, failed("mooncake:-707")),  # lease expired mid-transfer: never loaded
        (-800, failed("mooncake:-800")),
    ],
)
async def test_get_codes_map_to_outcomes(code: int, outcome: KeyOutcome) -> None:
    """Only a read of exactly the expected size is LOADED; not found is MISSING."""
    assert get_outcome(code, 4096) == outcome


async def test_store_satisfies_the_kvstore_protocol(store: MooncakeStore) -> None:
    """MooncakeStore is a KVStore, and moves values in pieces too."""
    assert isinstance(store, KVStore)
    assert isinstance(store, PiecewiseKVStore)


async def test_put_then_exists_then_get_is_byte_exact(
    store: MooncakeStore, staging: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """Stored values exist and load back byte for byte into other staging slices."""
    keys = [f"{request.node.name}-{i}" for i in range(4)]
    values = [staging[i * 64 * 1024 : (i + 1) * 64 * 1024] for i in range(4)]
    for i, value in enumerate(values):
        fill_random(value, i)
    outs = [staging[MIB + i * 64 * 1024 : MIB + (i + 1) * 64 * 1024] for i in range(4)]
    with anyio.fail_after(10):
        assert await store.put(keys, values) == [STORED] * 4
        assert await store.exists(
            [*keys, keys[0], f"{request.node.name}-absent"], [64 * 1024] * 4 + [100, 64 * 1024]
        ) == [Presence.PRESENT] * 4 + [Presence.FOREIGN, Presence.ABSENT]
        assert await store.get_into(keys, outs) == [LOADED] * 4
    for value, out in zip(values, outs, strict=True):
        assert torch.equal(value, out)


async def test_put_of_an_existing_key_is_present_and_keeps_the_old_bytes(
    store: MooncakeStore, staging: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """A second put of a key reports PRESENT and does not overwrite the stored value."""
    key = request.node.name
    first, second, out = staging[:4096], staging[4096:8192], staging[8192:12288]
    fill_random(first, 1)
    fill_random(second, 2)
    with anyio.fail_after(10):
        assert await store.put([key], [first]) == [STORED]
        assert await store.put([key, key], [second, second]) == [PRESENT, PRESENT]
        assert await store.get_into([key], [out]) == [LOADED]
    assert torch.equal(out, first)


async def test_duplicate_keys_in_one_put_store_once(
    store: MooncakeStore, staging: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """The first occurrence of a key in a batch is stored, later ones are PRESENT."""
    key = request.node.name
    with anyio.fail_after(10):
        outcomes = await store.put([key, key], [staging[:1024], staging[1024:2048]])
    assert outcomes == [STORED, PRESENT]


async def test_get_of_a_missing_key_is_missing(
    store: MooncakeStore, staging: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """A key never stored comes back MISSING, not loaded."""
    with anyio.fail_after(10):
        assert await store.get_into([request.node.name], [staging[:4096]]) == [MISSING]


async def test_key_removed_between_exists_and_get_is_missing(
    store: MooncakeStore, staging: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """A key removed after exists() said yes loads as MISSING, never as stale bytes."""
    key = request.node.name
    fill_random(staging[:4096], 7)
    with anyio.fail_after(10):
        assert await store.put([key], [staging[:4096]]) == [STORED]
        assert await store.exists([key], [4096]) == [Presence.PRESENT]
        # The put's lease (kv_lease_ttl_ms) protects the object for a moment.
        await poll_until(lambda: store.remove([key]))
        staging[8192:12288].fill_(0)
        assert await store.get_into([key], [staging[8192:12288]]) == [MISSING]
        assert await store.exists([key], [4096]) == [Presence.ABSENT]


async def test_a_buffer_of_the_wrong_size_fails(
    store: MooncakeStore, staging: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """A get into a buffer larger or smaller than the value fails, never LOADED."""
    key = request.node.name
    with anyio.fail_after(10):
        assert await store.put([key], [staging[:4096]]) == [STORED]
        larger, smaller = await store.get_into([key, key], [staging[:8192], staging[:1024]])
    assert larger.status is BlockStatus.FAILED
    assert smaller.status is BlockStatus.FAILED


async def test_values_outside_registered_buffers_fail_per_key(
    store: MooncakeStore, staging: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """A value outside every registered buffer fails alone; its batch neighbours go on."""
    stray = torch.zeros(4096, dtype=torch.uint8)
    keys = [f"{request.node.name}-stray", f"{request.node.name}-ok"]
    with anyio.fail_after(10):
        stray_outcome, ok_outcome = await store.put(keys, [stray, staging[:4096]])
    assert stray_outcome.status is BlockStatus.FAILED
    assert ok_outcome == STORED


def pages_of(memory: torch.Tensor, blocks: list[int], page: int, pages: int) -> numpy.ndarray:
    """Addresses of ``pages`` pages of ``page`` bytes per block, one page per "layer":
    layer j of block b lies at ``(j * 64 + b) * page`` bytes into ``memory``."""
    base = memory.data_ptr()
    return numpy.array([[base + (j * 64 + b) * page for j in range(pages)] for b in blocks],
                       dtype=numpy.int64)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine_memory(store: MooncakeStore) -> AsyncIterator[torch.Tensor]:
    """Memory standing in for an engine's KV tensors, registered while the tests run."""
    memory = torch.zeros(4 * 64 * 1024, dtype=torch.uint8)
    fill_random(memory, 11)
    store.register_memory(memory)
    yield memory
    store.unregister_memory(memory)


async def test_values_in_pieces_round_trip_and_read_as_one_value(
    store: MooncakeStore, staging: torch.Tensor, engine_memory: torch.Tensor,
    request: pytest.FixtureRequest,
) -> None:
    """A value put from an engine block's pages and its trailer is the concatenation of
    them: got back into other blocks' pages byte for byte, and into one staging buffer
    as the same bytes a contiguous put would have stored."""
    page = 1024
    keys = [f"{request.node.name}-{i}" for i in range(3)]
    trailers = staging[:24].view(3, 8)
    for i, trailer in enumerate(trailers):
        fill_random(trailer, 20 + i)
    with anyio.fail_after(10):
        assert await store.put_pieces(keys, Pieces(
            pages_of(engine_memory, [1, 2, 3], page, 4), (page,) * 4, trailers)) == [STORED] * 3
        assert await store.exists(keys, [4 * page + 8] * 3) == [Presence.PRESENT] * 3
        got = staging[4096:4096 + 3 * 8].view(3, 8)
        assert await store.get_pieces_into(keys, Pieces(
            pages_of(engine_memory, [11, 12, 13], page, 4), (page,) * 4, got)) == [LOADED] * 3
        whole = staging[MIB : MIB + 4 * page + 8]
        assert await store.get_into(keys[1:2], [whole]) == [LOADED]
    layers = engine_memory.view(4, 64, page)
    for source, target, trailer, back in zip((1, 2, 3), (11, 12, 13), trailers, got,
                                             strict=True):
        assert torch.equal(layers[:, target], layers[:, source])
        assert torch.equal(back, trailer)
    assert torch.equal(whole, torch.cat([*layers[:, 2], trailers[1]]))


async def test_pieces_outside_registered_memory_fail_per_value_and_store_nothing(
    store: MooncakeStore, engine_memory: torch.Tensor, request: pytest.FixtureRequest,
) -> None:
    """A value with any piece outside registered memory (a page past its end, a trailer
    past the end of the memory the others lie in, memory unregistered since) fails alone
    and is not stored."""
    page = 1024
    keys = [f"{request.node.name}-{name}" for name in ("ok", "past-end", "stray")]
    addresses = pages_of(engine_memory, [1, 2, 3], page, 2)
    addresses[1, 1] = engine_memory.data_ptr() + engine_memory.numel() - page // 2
    rows = torch.zeros(2 * 4096, dtype=torch.uint8)
    store.register_memory(rows[:4096])
    trailers = rows[4096 - 16 : 4096 + 8].view(3, 8)  # the last row lies past its end
    other = torch.zeros(64 * 1024, dtype=torch.uint8)
    store.register_memory(other)
    store.register_memory(other)  # twice: registered until unregistered twice
    store.unregister_memory(other)
    with anyio.fail_after(10):
        outcomes = await store.put_pieces(keys, Pieces(addresses, (page, page), trailers))
        assert await store.put_pieces([f"{request.node.name}-other"], Pieces(
            pages_of(other, [0], 512, 1), (512,), None)) == [STORED]
        store.unregister_memory(other)
        gone = await store.put_pieces([f"{request.node.name}-gone"], Pieces(
            pages_of(other, [1], 512, 1), (512,), None))
        assert await store.exists(keys[1:], [2 * page + 8] * 2) == [Presence.ABSENT] * 2
    store.unregister_memory(rows[:4096])
    assert outcomes == [STORED, failed("unregistered_buffer"), failed("unregistered_buffer")]
    assert gone == [failed("unregistered_buffer")]


async def test_trailers_that_are_not_rows_of_bytes_fail_every_value_and_store_nothing(
    store: MooncakeStore, staging: torch.Tensor, engine_memory: torch.Tensor,
    request: pytest.FixtureRequest,
) -> None:
    """Trailer rows whose bytes are not side by side (a column of a wider matrix, read
    across) are a bad buffer for every value of the batch, and none is stored."""
    keys = [f"{request.node.name}-{i}" for i in range(2)]
    across = staging[:32].view(8, 4).t()  # 4 rows of 8 bytes, each byte 4 apart
    with anyio.fail_after(10):
        outcomes = await store.put_pieces(keys, Pieces(
            pages_of(engine_memory, [1, 2], 1024, 2), (1024, 1024), across[:2]))
        assert await store.exists(keys, [2 * 1024 + 8] * 2) == [Presence.ABSENT] * 2
    assert outcomes == [failed("bad_buffer")] * 2


async def test_pieces_of_another_total_size_than_the_value_fail(
    store: MooncakeStore, engine_memory: torch.Tensor, request: pytest.FixtureRequest
) -> None:
    """A get into pieces larger or smaller in total than the stored value fails, never
    LOADED (an engine of another geometry never takes a value as its own)."""
    key = request.node.name
    with anyio.fail_after(10):
        assert await store.put_pieces([key], Pieces(
            pages_of(engine_memory, [1], 1024, 2), (1024, 1024), None)) == [STORED]
        larger, smaller = [
            (await store.get_pieces_into([key], Pieces(
                pages_of(engine_memory, [20], size, 2), (size, size), None)))[0]
            for size in (2048, 512)
        ]
    assert larger.status is BlockStatus.FAILED
    assert smaller.status is BlockStatus.FAILED


async def test_two_clients_see_each_others_keys(
    master: EmbeddedMaster, request: pytest.FixtureRequest
) -> None:
    """Two clients, each mounting its own segment on one master, read each other's keys."""
    with anyio.fail_after(30):
        async with (
            await open_mooncake_store(client_config(master)) as one,
            await open_mooncake_store(client_config(master)) as two,
        ):
            buffers = [torch.zeros(MIB, dtype=torch.uint8) for _ in range(2)]
            await one.register_buffer(buffers[0])
            await two.register_buffer(buffers[1])
            fill_random(buffers[0][:65536], 11)
            fill_random(buffers[1][:65536], 12)
            key_one, key_two = f"{request.node.name}-one", f"{request.node.name}-two"
            assert await one.put([key_one], [buffers[0][:65536]]) == [STORED]
            assert await two.put([key_two], [buffers[1][:65536]]) == [STORED]
            assert await two.exists([key_one], [65536]) == [Presence.PRESENT]
            assert await one.get_into([key_two], [buffers[0][MIB // 2 : MIB // 2 + 65536]]) == [
                LOADED
            ]
            assert await two.get_into([key_one], [buffers[1][MIB // 2 : MIB // 2 + 65536]]) == [
                LOADED
            ]
            assert torch.equal(buffers[0][MIB // 2 : MIB // 2 + 65536], buffers[1][:65536])
            assert torch.equal(buffers[1][MIB // 2 : MIB // 2 + 65536], buffers[0][:65536])


def resident_pages(memory: mmap.mmap) -> int:
    """How many of an anonymous mapping's pages have memory behind them (``mincore``)."""
    pages = len(memory) // mmap.PAGESIZE
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(memory)), vector) == 0
    return sum(flags & 1 for flags in vector)


async def test_faulting_memory_in_gives_every_page_memory_and_keeps_its_bytes() -> None:
    """What the store does to its segment as it opens: every page gets memory, and bytes
    already written (another client may be putting into the segment) stay as they were."""
    memory = mmap.mmap(-1, 8 * MIB)
    try:
        written = {3: b"three", 700: b"seven hundred", 2047: b"last"}
        for page, data in written.items():
            memory[page * mmap.PAGESIZE : page * mmap.PAGESIZE + len(data)] = data
        assert resident_pages(memory) == len(written)
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        with anyio.fail_after(10):
            # Unaligned ends, as a segment's may be: the pages wholly inside are faulted.
            await _prefault([(address + 100, address + 8 * MIB)])
        assert resident_pages(memory) == 8 * MIB // mmap.PAGESIZE - 1  # all but page 0
        for page, data in written.items():
            assert memory[page * mmap.PAGESIZE : page * mmap.PAGESIZE + len(data)] == data
        assert memory[mmap.PAGESIZE : 2 * mmap.PAGESIZE] == bytes(mmap.PAGESIZE)
    finally:
        memory.close()


async def test_a_store_faults_its_segment_in_as_it_opens(master: EmbeddedMaster) -> None:
    """Mooncake leaves its segment untouched (opening a client grows this process by
    some 50 MiB, whatever the segment's size), so a put into a page never written took
    a page fault; the store faults the segment in before it serves."""
    segment = 128 * MIB
    process = psutil.Process()
    before = process.memory_info().rss
    with anyio.fail_after(30):
        async with await open_mooncake_store(client_config(master, global_segment_bytes=segment)):
            grown = process.memory_info().rss - before
    assert grown >= segment, f"{grown / MIB:.0f} MiB resident after opening"


async def test_a_full_store_skips_puts_and_keeps_serving() -> None:
    """Puts beyond the segment come back STORE_FULL; stored keys still load, puts resume."""
    with anyio.fail_after(40):
        async with await open_mooncake_store(SMALL) as store:
            staging = torch.zeros(4 * MIB, dtype=torch.uint8)
            await store.register_buffer(staging)
            fill_random(staging, 3)
            keys = [f"full-{i}" for i in range(24)]
            values = [staging[(i % 4) * MIB : (i % 4 + 1) * MIB] for i in range(24)]
            outcomes = await store.put(keys, values)
            assert STORE_FULL in outcomes
            assert set(outcomes) <= {STORED, STORE_FULL}
            stored = [key for key, outcome in zip(keys, outcomes, strict=True) if outcome == STORED]
            assert stored

            out = staging[3 * MIB :]
            (loaded,) = await store.get_into(stored[:1], [out])
            assert loaded in (LOADED, MISSING)  # the master may have evicted it already
            if loaded == LOADED:
                assert torch.equal(out, values[keys.index(stored[0])])

            await poll_until(lambda: store.remove(stored[1:]))  # once the leases expire

            async def put_after() -> bool:
                return await store.put(["full-after"], [staging[:MIB]]) == [STORED]

            await poll_until(put_after)
            assert await store.exists(["full-after"], [MIB]) == [Presence.PRESENT]


async def test_closing_an_embedded_store_leaves_no_master_and_no_port() -> None:
    """After aclose() the embedded master process is gone and its ports are closed."""
    with anyio.fail_after(30):
        store = await open_mooncake_store(SMALL)
        embedded = store.master
        assert embedded is not None
        ports = master_ports(embedded.pid)
        assert len(ports) >= 2  # RPC and HTTP metadata at least
        await store.aclose()
        await store.aclose()  # idempotent
        assert not psutil.pid_exists(embedded.pid)
        assert not any(listening(port) for port in ports)
        with pytest.raises(StoreError):
            await store.exists(["after-close"], [1])


CHILD = """
import anyio
from pipeline.core.config import MooncakeStoreConfig
from pipeline.backends.stores.mooncake.setup import open_mooncake_store

async def main():
    store = await open_mooncake_store(MooncakeStoreConfig(
        global_segment_bytes=16 * 1024 * 1024, local_buffer_bytes=0))
    print("master_pid", store.master.pid, flush=True)
    await anyio.sleep_forever()

anyio.run(main)
"""


async def read_master_pid(owner: anyio.abc.Process) -> int:
    assert owner.stdout is not None
    text = ""
    async for chunk in TextReceiveStream(owner.stdout):
        text += chunk
        for line in text.split("\n")[:-1]:  # complete lines only
            if line.startswith("master_pid "):
                return int(line.split()[1])
    raise AssertionError(f"the owner exited before starting a master: {text}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_a_signalled_owner_leaves_no_master_behind(sig: signal.Signals) -> None:
    """A process that opened an embedded store and dies by signal takes its master along."""
    with anyio.fail_after(40):
        async with await anyio.open_process([sys.executable, "-c", CHILD], cwd=REPO) as owner:
            master_pid = await read_master_pid(owner)
            master_process = psutil.Process(master_pid)
            assert master_process.ppid() == owner.pid
            assert master_process.name() == "mooncake_master"
            ports = master_ports(master_pid)
            assert ports
            owner.send_signal(sig)
            await owner.wait()
        await poll_until(lambda: anyio.to_thread.run_sync(gone, master_process))
        assert not any(listening(port) for port in ports)


async def test_an_unreachable_master_raises_a_clear_store_error() -> None:
    """A master address nobody listens on fails fast with a StoreError naming it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = replace(
        SMALL,
        master=f"127.0.0.1:{port}",
        metadata_server=f"http://127.0.0.1:{port}/metadata",
        call_timeout_s=1.0,
    )
    with anyio.fail_after(10), pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        await open_mooncake_store(config)


async def test_a_missing_master_binary_says_what_to_install() -> None:
    """An embedded master whose binary is missing names the package to install."""
    config = replace(SMALL, master_binary="no-such-mooncake-master")
    with anyio.fail_after(10), pytest.raises(StoreError, match="mooncake-transfer-engine"):
        await open_mooncake_store(config)


async def test_calls_after_the_master_died_raise_store_error() -> None:
    """When the master is gone, exists() raises StoreError instead of reporting misses."""
    with anyio.fail_after(30):
        store = await open_mooncake_store(SMALL)
        try:
            assert store.master is not None
            assert await store.exists(["before"], [1]) == [Presence.ABSENT]
            psutil.Process(store.master.pid).kill()
            with pytest.raises(StoreError, match="unreachable"):
                await store.exists(["after"], [1])
        finally:
            await store.aclose()


async def test_a_hung_master_times_out_and_the_store_serves_again_once_the_call_returns(
    master: EmbeddedMaster,
) -> None:
    """A call past call_timeout_s is abandoned (its buffers must not be reused), later
    calls are refused at once, and once the master answers and the abandoned call has
    returned, the store serves again without a restart.

    The master hangs behind a relay that stops passing bytes: connections stay open and
    nothing answers, as with a master that is stuck or a network that drops everything.
    """
    with anyio.fail_after(30):
        async with stall_proxy(master.endpoints.master_address) as (proxy, address):
            config = replace(client_config(master, call_timeout_s=1.0), master=address)
            async with await open_mooncake_store(config) as store:
                assert await store.exists(["before"], [1]) == [Presence.ABSENT]
                assert await proxy.command("stall") == "stalled"
                with pytest.raises(StoreCallAbandoned, match="call_timeout_s") as abandoned:
                    await store.exists(["while-hung"], [1])
                returned = anyio.Event()
                abandoned.value.when_returned(returned.set)
                with anyio.fail_after(0.5), pytest.raises(StoreError, match="refuses calls"):
                    await store.exists(["refused-at-once"], [1])
                assert not returned.is_set()
                assert await proxy.command("resume") == "resumed"
                await returned.wait()
                assert await store.exists(["after-resume"], [1]) == [Presence.ABSENT]


async def test_calls_past_max_concurrent_calls_wait_for_a_slot_and_may_give_up_waiting(
    master: EmbeddedMaster,
) -> None:
    """With every slot taken by a call the master does not answer, the next call waits
    for a slot without reaching the master, and a caller may give up on that wait; the
    slot is free again once the call holding it returns."""
    with anyio.fail_after(30):
        async with stall_proxy(master.endpoints.master_address) as (proxy, address):
            config = replace(client_config(master, call_timeout_s=10.0,
                                           max_concurrent_calls=1), master=address)
            async with await open_mooncake_store(config) as store:
                assert await store.exists(["before"], [1]) == [Presence.ABSENT]
                assert await proxy.command("stall") == "stalled"
                held: list[list[Presence]] = []

                async def holding() -> None:
                    held.append(await store.exists(["holds-the-slot"], [1]))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(holding)
                    await anyio.sleep(0.2)  # it has the only slot, and waits on the master
                    # A call that reached the master would wait on it, shielded, for
                    # call_timeout_s: this one waits for the slot, and gives up at once.
                    with anyio.move_on_after(0.3) as waiting:
                        await store.exists(["waits-for-a-slot"], [1])
                    assert waiting.cancelled_caught
                    assert await proxy.command("resume") == "resumed"
                assert held == [[Presence.ABSENT]]
                assert await store.exists(["after"], [1]) == [Presence.ABSENT]


@dataclasses.dataclass
class InPlace:
    geometry: StoreGroupGeometry
    pool: StagingPool
    memory: InPlaceMemory
    engine: InPlaceCopyEngine
    layers: list[torch.Tensor]


async def in_place_engine(store: MooncakeStore, helpers: HelperThreads | None = None, *,
                          through: PiecewiseKVStore | None = None) -> InPlace:
    """A two-layer engine's memory registered with ``store``, its store group, and the
    in-place memory (over ``through``, a wrapper of ``store``, if given) and copy engine
    over them (checksums on, shared with ``helpers``)."""
    layout = KVCacheLayout.from_dict({"model": "m", "groups": [
        {"kind": "full_attention", "block_size": 16, "layers": ["a", "b"]}]})
    layers = [torch.randint(0, 256, (32, 2, 16, 1024), dtype=torch.uint8) for _ in range(2)]
    for layer in layers:
        store.register_memory(layer.view(-1))
    (geometry,) = build_store_groups(
        layout, {name: (layer, 0) for name, layer in zip("ab", layers, strict=True)})
    pool = StagingPool(4 * 4096, 4096, load_slots=1)
    await store.register_buffer(pool.buffer)
    return InPlace(geometry, pool,
                   InPlaceMemory(pool, through or store, skip_when_full=False,
                                 helpers=helpers),
                   InPlaceCopyEngine(), layers)


class ReadsSeen:
    """A Mooncake store whose loads count the batches it read where they lie, each
    after ``delay_s``."""

    def __init__(self, store: MooncakeStore, delay_s: float = 0.0) -> None:
        self.store = store
        self.delay_s = delay_s
        self.read = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def get_pieces_into(self, keys: Sequence[str], buffers: Pieces, *,
                              measure: Seal | None = None,
                              read: ReadHere | None = None) -> list[KeyOutcome]:
        assert read is not None

        def counted(positions: Sequence[int], sources: Sequence[int]) -> None:
            self.read += 1
            time.sleep(self.delay_s)
            read(positions, sources)

        return await self.store.get_pieces_into(keys, buffers, measure=measure, read=counted)


READ_HERE = pytest.mark.parametrize("read_here", [True, False],
                                    ids=["read where they lie", "through the get"])


@READ_HERE
@pytest.mark.parametrize("shared", [False, True], ids=["alone", "checksums shared"])
async def test_values_moved_in_place_load_byte_exact_into_other_blocks(
    master: EmbeddedMaster, request: pytest.FixtureRequest, shared: bool, read_here: bool,
) -> None:
    """Saved from engine blocks and loaded into others with no copy in between: every
    page arrives, every checksum checks, and the staging pool holds only checksums;
    alike when a helper thread shares the checksums and copies of every batch, and
    whether the load reads the values where they lie in this client's segment or
    through Mooncake's get."""
    keys = [f"{request.node.name}-{i}" for i in range(3)]
    helpers = HelperThreads(1, share_bytes=0) if shared else None
    with anyio.fail_after(30):
        async with await open_mooncake_store(
                client_config(master, read_here=read_here, kv_lease_ttl_ms=LONG_LEASE_MS),
        ) as store:
            seen = ReadsSeen(store)
            kv = await in_place_engine(store, helpers, through=seen)
            saved = await kv.memory.reserve(kv.geometry, [1, 2, 3], keys)
            await kv.engine.gather(kv.geometry, [1, 2, 3], saved.runs)
            assert await kv.memory.store(saved) == [STORED] * 3
            loaded = await kv.memory.fetch(kv.geometry, [7, 8, 9], keys)
            assert loaded.outcomes == [LOADED] * 3
            assert await kv.engine.scatter(kv.geometry, [7, 8, 9], loaded.runs) == [True] * 3
            loaded.release()
            for layer in kv.layers:
                store.unregister_memory(layer.view(-1))
            reads_here = store.reads_here()
    if helpers is not None:
        helpers.close()
    assert seen.read == int(read_here) and reads_here == ((3, 0) if read_here else (0, 0))
    assert kv.pool.free_slots("load") == 1 and kv.pool.free_slots("save") == 3
    for layer in kv.layers:
        assert torch.equal(layer[7:10], layer[1:4])


@contextlib.asynccontextmanager
async def stalling_in_place(
    master: EmbeddedMaster,
) -> AsyncIterator[tuple[StallProxy, MooncakeStore, InPlace]]:
    """A store whose master sits behind a relay that can stall it (call_timeout_s 1 s),
    and an in-place engine on it."""
    async with stall_proxy(master.endpoints.master_address) as (proxy, address):
        config = replace(client_config(master, call_timeout_s=1.0), master=address)
        async with await open_mooncake_store(config) as store:
            kv = await in_place_engine(store)
            yield proxy, store, kv
            for layer in kv.layers:
                store.unregister_memory(layer.view(-1))


async def test_an_abandoned_get_into_engine_memory_is_answered_once_it_returns(
    master: EmbeddedMaster, request: pytest.FixtureRequest,
) -> None:
    """A get into engine blocks past call_timeout_s may still write them: the fetch
    answers (failed) only once the call has returned, so the engine never reuses blocks
    the store may still write; its checksum slot is out of use until then too."""
    keys = [f"{request.node.name}-{i}" for i in range(2)]
    with anyio.fail_after(30):
        async with stalling_in_place(master) as (proxy, store, kv):
            saved = await kv.memory.reserve(kv.geometry, [1, 2], keys)
            assert await kv.memory.store(saved) == [STORED] * 2
            assert await proxy.command("stall") == "stalled"
            answered: list[list[KeyOutcome]] = []

            async def load() -> None:
                fetched = await kv.memory.fetch(kv.geometry, [5, 6], keys)
                answered.append(fetched.outcomes)
                fetched.release()

            returned = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(load)
                while not kv.pool.withheld:  # noqa: ASYNC110 - until the call is given up on
                    await anyio.sleep(0.05)
                await anyio.sleep(0.5)
                assert not answered
                store.when_calls_returned(returned.set)
                assert not returned.is_set()
                assert await proxy.command("resume") == "resumed"
            assert returned.is_set()
            assert kv.pool.withheld == 0 and kv.pool.free_slots("load") == 1
    assert [outcome.status for outcome in answered[0]] == [BlockStatus.FAILED] * 2


async def test_an_abandoned_put_from_engine_memory_is_answered_at_once(
    master: EmbeddedMaster, request: pytest.FixtureRequest,
) -> None:
    """A put past call_timeout_s only reads engine memory, under checksums sealed
    before: its batch is answered (failed) at once, while the memory is reported in use
    until the call has returned (it must stay mapped until then)."""
    keys = [f"{request.node.name}-{i}" for i in range(2)]
    with anyio.fail_after(30):
        async with stalling_in_place(master) as (proxy, store, kv):
            saved = await kv.memory.reserve(kv.geometry, [1, 2], keys)
            assert await proxy.command("stall") == "stalled"
            with anyio.fail_after(10):  # well before Mooncake's own 30 s
                outcomes = await kv.memory.store(saved)
            returned = anyio.Event()
            store.when_calls_returned(returned.set)
            assert not returned.is_set() and kv.pool.withheld == 1
            assert await proxy.command("resume") == "resumed"
            await returned.wait()
    assert [outcome.status for outcome in outcomes] == [BlockStatus.FAILED] * 2
    assert kv.pool.withheld == 0


@READ_HERE
async def test_a_value_whose_pages_changed_in_the_store_fails_its_check(
    master: EmbeddedMaster, request: pytest.FixtureRequest, read_here: bool,
) -> None:
    """A value stored in place, then replaced by the same bytes with one page byte
    flipped (its sealed checksum kept), fails its check; its neighbour in the batch
    loads intact. Read where it lies, it is checked before any of it is copied, and its
    engine block keeps its own bytes; through Mooncake's get, it is measured where it
    landed."""
    keys = [f"{request.node.name}-{i}" for i in range(2)]
    with anyio.fail_after(30):
        async with await open_mooncake_store(
                client_config(master, read_here=read_here, kv_lease_ttl_ms=LONG_LEASE_MS),
        ) as store:
            kv = await in_place_engine(store)
            own = [layer[7].clone() for layer in kv.layers]
            size = kv.geometry.stored_bytes
            whole = torch.zeros(size, dtype=torch.uint8)
            await store.register_buffer(whole)
            saved = await kv.memory.reserve(kv.geometry, [1, 2], keys)
            assert await kv.memory.store(saved) == [STORED] * 2
            assert await store.get_into(keys[:1], [whole]) == [LOADED]
            whole[100] ^= 0xFF
            assert await store.remove(keys[:1]) == 1
            assert await store.put(keys[:1], [whole]) == [STORED]
            loaded = await kv.memory.fetch(kv.geometry, [7, 8], keys)
            assert loaded.outcomes == [LOADED] * 2
            intact = await kv.engine.scatter(kv.geometry, [7, 8], loaded.runs)
            loaded.release()
            for layer in kv.layers:
                store.unregister_memory(layer.view(-1))
    assert intact == [False, True]
    assert torch.equal(kv.layers[1][8], kv.layers[1][2])
    landed = [layer[7] for layer in kv.layers]
    stored = [layer[1] for layer in kv.layers]
    if read_here:
        assert all(torch.equal(a, b) for a, b in zip(landed, own, strict=True))
    else:  # the flipped byte, 100 bytes into the value, is in the first layer's page
        assert not torch.equal(landed[0], stored[0])
        assert torch.equal(landed[1], stored[1])


async def test_a_load_read_here_after_its_lease_may_have_ended_fails(
    master: EmbeddedMaster, request: pytest.FixtureRequest,
) -> None:
    """The read lease the values' descriptors took must still hold once they are
    copied: a copy that ends past half of it fails every value (the master may have
    evicted one and given its memory to another meanwhile); one within it loads."""
    keys = [f"{request.node.name}-{i}" for i in range(2)]
    with anyio.fail_after(30):
        for lease_ms, expected in ((20, [failed("mooncake:-707")] * 2),
                                   (LONG_LEASE_MS, [LOADED] * 2)):
            async with await open_mooncake_store(
                    client_config(master, kv_lease_ttl_ms=lease_ms)) as store:
                seen = ReadsSeen(store, delay_s=0.05)
                kv = await in_place_engine(store, through=seen)
                saved = await kv.memory.reserve(kv.geometry, [1, 2], keys)
                assert await kv.memory.store(saved) == [STORED] * 2
                loaded = await kv.memory.fetch(kv.geometry, [7, 8], keys)
                outcomes = loaded.outcomes
                loaded.release()
                for layer in kv.layers:
                    store.unregister_memory(layer.view(-1))
                assert await store.remove(keys) == 2
                reads_here = store.reads_here()
            assert seen.read == 1 and outcomes == expected
            assert reads_here == ((2, 0) if expected == [LOADED] * 2 else (0, 2))


async def test_values_in_another_clients_segment_load_through_mooncake(
    master: EmbeddedMaster, request: pytest.FixtureRequest,
) -> None:
    """A value another client stored lies in that client's segment: a load moves it
    through Mooncake's get, byte-exact, and reads nothing where it lies."""
    keys = [f"{request.node.name}-{i}" for i in range(2)]
    config = client_config(master, kv_lease_ttl_ms=LONG_LEASE_MS)
    with anyio.fail_after(30):
        async with await open_mooncake_store(config) as saver, \
                await open_mooncake_store(config) as loader:
            source = await in_place_engine(saver)
            saved = await source.memory.reserve(source.geometry, [1, 2], keys)
            assert await source.memory.store(saved) == [STORED] * 2
            seen = ReadsSeen(loader)
            target = await in_place_engine(loader, through=seen)
            target.layers[0].zero_()
            loaded = await target.memory.fetch(target.geometry, [7, 8], keys)
            assert loaded.outcomes == [LOADED] * 2
            assert await target.engine.scatter(target.geometry, [7, 8],
                                               loaded.runs) == [True] * 2
            loaded.release()
            for kv, store in ((source, saver), (target, loader)):
                for layer in kv.layers:
                    store.unregister_memory(layer.view(-1))
    assert seen.read == 0
    for mine, theirs in zip(target.layers, source.layers, strict=True):
        assert torch.equal(mine[7:9], theirs[1:3])


class _Named:
    def get_hostname(self) -> str:
        return "127.0.0.1:1"


@pytest.mark.parametrize("metadata_server", ["P2PHANDSHAKE", "http://127.0.0.1:{port}/metadata"])
async def test_where_the_segment_lies_is_unknown_without_an_http_metadata_server_to_say(
    metadata_server: str,
) -> None:
    """Without an HTTP metadata server, or with one that does not answer, the store does
    not know where its segment lies, and loads move through Mooncake's get."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    endpoints = MasterEndpoints("127.0.0.1:2", metadata_server.format(port=port))
    with anyio.fail_after(10):
        assert await _segment_here(SMALL, endpoints, _Named()) == []  # type: ignore[arg-type]
