"""Hostile peers against a live sidecar: one bad frame costs its sender an error reply (a
frame over the size limit, its connection), nothing more. After every attack the sidecar
still runs, an honest engine beside the attacker had every lookup answered within a
second while the attack was in flight, and honest engines still save and load
byte-exact. Attackers speak raw frames on their own DEALER sockets."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.errors import TransportError
from pipeline.core.hashing import block_hashes
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import (
    EngineMessage,
    ErrorReply,
    Explain,
    HashSelfTest,
    Heartbeat,
    Load,
    Lookup,
    LookupReply,
    Register,
    Registered,
    Save,
    SaveDone,
    SidecarMessage,
    TensorHandle,
    Unregister,
    Unregistered,
    decode_sidecar_message,
    encode,
    pack_tokens,
)
from pipeline.testing import SidecarProcess, handed_over, run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens
from transport.client import EngineClient, SaveResult
from transport.tensors import Segments, tensor_handle

T = TypeVar("T")

TIMEOUT = 60
LIVENESS_S = 1.0
"""No honest lookup may wait longer than this while an attack is in flight."""
MiB = 1 << 20
HONEST_LAYOUT = hybrid_layout(page_bytes=16 * 1024)
SEEDS = itertools.count(5000)


# -- helpers -----------------------------------------------------------------------------


def memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of a process, in bytes ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = status.read().splitlines()
    except OSError:
        return {}
    fields = (line.split() for line in lines)
    return {f[0][:-1]: int(f[1]) * 1024 for f in fields
            if f and f[0] in ("VmRSS:", "RssAnon:", "RssShmem:")}


def single_layout(page_bytes: int, block_size: int = 16, **extra: Any) -> dict[str, Any]:
    """One full-attention group of one layer, ``attn.0``."""
    return {"model": "hostile", "groups": [{"kind": "full_attention", "block_size": block_size,
                                            "layers": ["attn.0"], "page_bytes": page_bytes}],
            **extra}


HANDED: dict[str, list[int]] = {}
"""Engine id -> the memory files its registration hands over (``Peer.send``)."""


def registration(engine: KVEngine, engine_id: str, *,
                 handles: tuple[TensorHandle, ...] | None = None,
                 layout: dict[str, Any] | None = None,
                 self_test: HashSelfTest | None = None,
                 fds: list[int] | None = None) -> Register:
    """A genuine Register of ``engine``'s tensors, as EngineClient.connect builds it; any
    part may be replaced (``fds``: the memory files ``handles`` name). A peer sending it
    hands those files over first."""
    # The layout's projections, from the parts that decode (a hostile one may not).
    parsed = engine.layout if layout is None else KVCacheLayout.from_dict(
        {"groups": layout["groups"]})
    payload = {layer for layers in parsed.payload_layers for layer in layers}
    segments = Segments()
    if handles is None:
        handles = tuple(tensor_handle(layer, tensor, segments) for layer, tensor
                        in engine.kv_caches.items() if layer in payload)
    HANDED[engine_id] = segments.fds if fds is None else fds
    if self_test is None:
        tokens = tuple(range(1, 2 * parsed.hash_block_size + 1))
        self_test = HashSelfTest(tokens, tuple(block_hashes(tokens, parsed.hash_block_size)))
    return Register(engine_id, layout if layout is not None else parsed.to_dict(), handles,
                    self_test)


class Peer:
    """A raw DEALER socket of its own: frames go out as given, replies come back decoded."""

    def __init__(self, sidecar: SidecarProcess, name: str) -> None:
        self.sidecar = sidecar
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, f"{name}-{uuid.uuid4().hex[:8]}".encode())
        self.socket.connect(sidecar.endpoint)

    def send(self, frame: bytes | EngineMessage) -> None:
        if isinstance(frame, Register) and not frame.handover and HANDED.get(frame.engine_id):
            frame = handed_over(self.socket, frame, HANDED[frame.engine_id])
        self.socket.send(frame if isinstance(frame, bytes) else encode(frame))

    def recv(self, timeout_s: float = 30.0) -> SidecarMessage | None:
        """The next reply; None after ``timeout_s``, or at once if the sidecar has died."""
        deadline = time.monotonic() + timeout_s
        while not self.socket.poll(50):
            if time.monotonic() > deadline or self.sidecar.process.poll() is not None:
                return None
        return decode_sidecar_message(self.socket.recv())

    def call(self, frame: bytes | EngineMessage, timeout_s: float = 30.0) -> SidecarMessage | None:
        self.send(frame)
        return self.recv(timeout_s)

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


@contextlib.contextmanager
def peer(sidecar: SidecarProcess, name: str = "attacker") -> Iterator[Peer]:
    attacker = Peer(sidecar, name)
    try:
        yield attacker
    finally:
        attacker.close()


class Watch:
    """An honest engine's lookups in a loop, each one's wait, and the sidecar's memory."""

    def __init__(self, sidecar: SidecarProcess, client: EngineClient, tokens: list[int]) -> None:
        self.pid, self.client, self.tokens = sidecar.pid, client, tokens
        self.before = memory(self.pid)
        self.peak = dict(self.before)
        self.waits: list[float] = []
        self.errors: list[str] = []
        self.done = anyio.Event()

    def sample(self) -> None:
        for field, value in memory(self.pid).items():
            self.peak[field] = max(self.peak.get(field, 0), value)

    def growth(self, field: str) -> int:
        self.sample()
        return self.peak.get(field, 0) - self.before.get(field, 0)

    @property
    def worst(self) -> float:
        return max(self.waits, default=math.inf)

    async def run(self, stop: anyio.Event) -> None:
        try:
            while not stop.is_set() and not self.errors:
                started = time.monotonic()
                try:
                    await self.client.lookup(self.tokens)
                except anyio.get_cancelled_exc_class():
                    self.errors.append("a lookup never answered")
                    raise
                except Exception as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                finally:  # a lookup cut short by the end of the watch counts as it stood
                    self.waits.append(time.monotonic() - started)
                self.sample()
                await anyio.sleep(0.005)
        finally:
            self.done.set()


async def _cancel_on_exit(sidecar: SidecarProcess, scope: anyio.CancelScope) -> None:
    while True:
        await anyio.sleep(0.05)
        if sidecar.process.poll() is not None:
            scope.cancel()
            return


async def under_attack(sidecar: SidecarProcess, client: EngineClient, tokens: list[int],
                       attack: Callable[[], Awaitable[T]]) -> tuple[T | str, Watch]:
    """Run ``attack`` while ``client`` looks ``tokens`` up again and again; the attack is
    cut short if the sidecar exits."""
    watch = Watch(sidecar, client, tokens)
    stop = anyio.Event()
    result: T | str = "none: the sidecar exited"
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch.run, stop)
        try:
            with anyio.CancelScope() as attack_scope:
                tg.start_soon(_cancel_on_exit, sidecar, attack_scope)
                result = await attack()
                await anyio.sleep(0.2)
        finally:
            stop.set()
            if sidecar.process.poll() is None:
                with anyio.move_on_after(2):
                    await watch.done.wait()
            tg.cancel_scope.cancel()
    return result, watch


def in_thread(attack: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    return lambda: anyio.to_thread.run_sync(attack)


@contextlib.asynccontextmanager
async def honest_engine(sidecar: SidecarProcess) -> AsyncIterator[tuple[EngineClient, list[int]]]:
    """A registered engine with a saved prompt to look up."""
    engine = KVEngine(HONEST_LAYOUT)
    tokens = random_tokens(4 * 16 + 1, seed=next(SEEDS))
    async with await engine.connect(sidecar.endpoint, timeout_s=15, lookup_spin_s=0) as client:
        assert (await client.save("honest", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]])).stored
        yield client, tokens


async def serves_byte_exact(sidecar: SidecarProcess) -> str:
    """"ok" if one fresh engine saves and another loads the same bytes back, else what
    went wrong."""
    if sidecar.process.poll() is not None:
        return "sidecar gone"
    layout = HONEST_LAYOUT
    a, b = KVEngine(layout), KVEngine(layout)
    tokens = random_tokens(3 * 16 + 1, seed=next(SEEDS))
    try:
        with anyio.fail_after(20):
            async with await a.connect(sidecar.endpoint, timeout_s=5) as ca, \
                    await b.connect(sidecar.endpoint, timeout_s=5) as cb:
                saved = await ca.save("exact", tokens, [[1, 2, 3], [4], [1, 2, 3]])
                hit = await cb.lookup(tokens)
                loaded = await cb.load("exact", tokens, [[11, 12, 13], [9], [21, 22, 23]], 48)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    if saved.stored != 6 or hit != 48 or loaded.loaded_tokens != 48:
        return f"stored {saved.stored}/6, hit {hit}/48, loaded {loaded.loaded_tokens}/48"
    if not all(a.same_block(0, 1 + i, b, 11 + i) for i in range(3)):
        return "loaded bytes differ from the saved ones"
    return "ok"


async def peer_attack(sidecar: SidecarProcess, attack: Callable[[Peer], T], *,
                      registered_first: Register | None = None,
                      ) -> tuple[T | str, Watch, str]:
    """``attack(peer)`` from a raw peer (registered first with ``registered_first``), in a
    thread, while an honest engine looks up; what it returned, the watch, and whether
    engines still save and load byte-exact afterwards."""
    with anyio.fail_after(TIMEOUT):
        async with honest_engine(sidecar) as (client, tokens):
            with peer(sidecar) as attacker:
                if registered_first is not None:
                    assert isinstance(attacker.call(registered_first), Registered)
                reply, watch = await under_attack(
                    sidecar, client, tokens, in_thread(lambda: attack(attacker)))
        after = await serves_byte_exact(sidecar)
    return reply, watch, after


async def frame_attack(sidecar: SidecarProcess, frame: bytes | EngineMessage, *,
                       registered_first: Register | None = None,
                       ) -> tuple[object, Watch, str]:
    """``peer_attack`` of one frame: the reply to it."""
    return await peer_attack(sidecar, lambda attacker: attacker.call(frame),
                             registered_first=registered_first)


def describe(reply: object) -> str:
    if reply is None:
        return "no reply"
    if isinstance(reply, str):
        return reply
    if isinstance(reply, ErrorReply):
        return f"ErrorReply({reply.code}: {reply.message[:80]})"
    if isinstance(reply, SaveDone):
        stored = sum(block.status == "stored" for block in reply.blocks)
        return f"SaveDone({len(reply.blocks)} blocks, {stored} stored)"
    if isinstance(reply, SaveResult):
        return f"SaveResult({reply.stored} stored, {reply.skipped} skipped, {reply.failed} failed)"
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"[:200]
    return type(reply).__name__


def summary(sidecar: SidecarProcess, watch: Watch, reply: object, after: str) -> str:
    errors = f" ({watch.errors[0]})" if watch.errors else ""
    return (f"sidecar exit status {sidecar.process.poll()}; worst honest lookup "
            f"{watch.worst:.2f}s of {len(watch.waits)}{errors}; RssAnon "
            f"{watch.growth('RssAnon') / MiB:+.0f} MiB, VmRSS {watch.growth('VmRSS') / MiB:+.0f} "
            f"MiB; attacker's reply: {describe(reply)}; afterwards: {after}")


def assert_contained(sidecar: SidecarProcess, watch: Watch, reply: object, after: str,
                     *, error_reply: bool = True) -> str:
    """The contract every attack is held to; returns the figures for further checks
    (printed too: ``pytest -rP`` shows each attack's)."""
    figures = summary(sidecar, watch, reply, after)
    print(figures)
    assert sidecar.process.poll() is None, figures
    if error_reply:
        assert isinstance(reply, ErrorReply), figures
    assert watch.worst < LIVENESS_S, figures
    assert after == "ok", figures
    return figures


@pytest.fixture
def fresh_sidecar() -> Iterator[SidecarProcess]:
    """A sidecar of its own, for an attack that may kill it or leave memory behind."""
    with run_sidecar_process() as process:
        yield process


@pytest.fixture(scope="module")
def sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process() as process:
        yield process


# -- attacks -----------------------------------------------------------------------------


async def test_a_register_with_an_overflowing_stride_costs_an_error_reply(
    fresh_sidecar: SidecarProcess,
) -> None:
    """A tensor handle with a stride of 2**64 - 1 on a dimension of size 1 (genuine
    otherwise, over real memory of the engine) is refused with an error reply."""
    layout = single_layout(page_bytes=8192)
    engine = KVEngine(layout, num_blocks=16)  # attn.0: [16, 4096] bfloat16
    segments = Segments()
    genuine = tensor_handle("attn.0", engine.kv_caches["attn.0"], segments)
    hostile = msgspec.structs.replace(genuine, shape=(16, 4096, 1),
                                      strides=(4096, 1, 2**64 - 1))
    frame = registration(engine, "strides", handles=(hostile,), fds=segments.fds)
    reply, watch, after = await frame_attack(fresh_sidecar, frame)
    assert_contained(fresh_sidecar, watch, reply, after)


def test_memory_the_project_allocates_cannot_shrink() -> None:
    """A KV memory file from ``shared_kv_tensor`` is sealed: its owner cannot truncate it
    under a sidecar that maps it."""
    engine = KVEngine(HONEST_LAYOUT)
    segments = Segments()
    for layer, tensor in engine.kv_caches.items():
        tensor_handle(layer, tensor, segments)
        fd = segments.fds[-1]
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)


async def test_a_memory_file_that_shrinks_cannot_kill_the_sidecar(
    fresh_sidecar: SidecarProcess,
) -> None:
    """An engine whose KV memory was shared in place (not sealed, as vLLM's is) that
    truncates its memory files to nothing after registering, then saves, gets none of
    those blocks stored; the sidecar lives, and another engine of the same layout finds
    nothing of that prompt."""
    shrinking = KVEngine(HONEST_LAYOUT)
    shrinking.kv_caches = {layer: tensor.clone() for layer, tensor
                           in shrinking.kv_caches.items()}  # plain memory, not shared
    segments = Segments()
    for layer, tensor in shrinking.kv_caches.items():
        tensor_handle(layer, tensor, segments, share_in_place=True)
    fds = set(segments.fds)
    tokens = random_tokens(4 * 16 + 1, seed=next(SEEDS))
    with anyio.fail_after(TIMEOUT):
        async with honest_engine(fresh_sidecar) as (client, honest_tokens), \
                await EngineClient.connect(
                    fresh_sidecar.endpoint, layout=shrinking.layout,
                    kv_caches=shrinking.kv_caches, share_in_place=True,
                    timeout_s=10) as attacker:
            for fd in fds:  # nothing here may touch shrinking's tensors from now on
                os.ftruncate(fd, 0)

            async def attack() -> object:
                try:
                    return await attacker.save("shrunk", tokens, [[1, 2, 3, 4], [5],
                                                                  [1, 2, 3, 4]])
                except Exception as exc:
                    return exc

            result, watch = await under_attack(fresh_sidecar, client, honest_tokens, attack)
            later_hit: object = "none: the sidecar exited"
            if fresh_sidecar.process.poll() is None:
                try:
                    later_hit = await client.lookup(tokens, timeout_s=5)
                except Exception as exc:
                    later_hit = exc
        after = await serves_byte_exact(fresh_sidecar)
    stored = getattr(result, "stored", 0)
    figures = assert_contained(fresh_sidecar, watch, result, after, error_reply=False)
    figures += f"; save reported {stored} stored; a later lookup hit {later_hit}"
    assert stored == 0, figures
    assert later_hit == 0, figures


async def test_a_huge_self_test_does_not_stall_other_engines(sidecar: SidecarProcess) -> None:
    """A registration whose self-test names 2,000,000 tokens (negative ones, hashed the
    slow way) at one token per block is refused without holding up anyone's lookups."""
    layout = single_layout(page_bytes=16 * 1024, block_size=1)
    engine = KVEngine(layout, num_blocks=16)
    frame = encode(registration(engine, "self-test", self_test=HashSelfTest(
        (-1,) * 2_000_000, (b"\0" * 32,))))
    reply, watch, after = await frame_attack(sidecar, frame)
    assert_contained(sidecar, watch, reply, after)


async def test_a_save_naming_millions_of_blocks_is_refused_cheaply(
    fresh_sidecar: SidecarProcess,
) -> None:
    """A registered engine's save of 3,000,000 block ids in one group and no tokens costs
    the sidecar neither its loop nor its memory: refused, or a few blocks answered."""
    engine = KVEngine(HONEST_LAYOUT)
    frame = encode(Save(1, "millions", pack_tokens([]), ((1,) * 3_000_000, (), ())))
    reply, watch, after = await frame_attack(
        fresh_sidecar, frame, registered_first=registration(engine, "millions"))
    figures = assert_contained(fresh_sidecar, watch, reply, after, error_reply=False)
    assert isinstance(reply, ErrorReply | SaveDone), figures
    assert not isinstance(reply, SaveDone) or len(reply.blocks) <= 64, figures
    assert watch.growth("RssAnon") < 256 * MiB, figures


async def test_a_legal_looking_save_of_a_million_one_token_blocks_is_refused_by_name(
    fresh_sidecar: SidecarProcess,
) -> None:
    """An engine of one-token blocks hashing for itself saves a million tokens, every
    block named: within the token limit, but a million blocks of work; refused at once
    as over ``limits.max_request_blocks``, without holding anyone's lookups."""
    layout = single_layout(page_bytes=64, block_size=1)
    engine = KVEngine(layout, num_blocks=8)
    register = msgspec.structs.replace(registration(engine, "tiny-blocks"), hash_algo="xxhash")
    count = 1_000_000
    frame = encode(Save(1, "million", pack_tokens([7] * count), ((1,) * count,),
                        block_hashes=tuple(i.to_bytes(8, "little") for i in range(count))))
    reply, watch, after = await frame_attack(
        fresh_sidecar, frame, registered_first=register)
    figures = assert_contained(fresh_sidecar, watch, reply, after)
    assert isinstance(reply, ErrorReply) and reply.code == "over_limit", figures
    assert "limits.max_request_blocks" in reply.message, figures


async def test_a_sparse_memory_file_is_not_populated_at_the_sidecars_expense(
    fresh_sidecar: SidecarProcess,
) -> None:
    """A tensor over a 2 GiB memory file with nothing written in it does not get its
    pages filled in by the sidecar, on its loop or on its memory."""
    size = 2 << 30
    page_bytes = 16 * 1024
    layout = single_layout(page_bytes=page_bytes)
    fd = os.memfd_create("hostile-sparse", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        handle = TensorHandle("attn.0", 0, (size // page_bytes, page_bytes // 2),
                              (page_bytes // 2, 1), "bfloat16", segment=0)
        frame = registration(KVEngine(layout, num_blocks=1), "sparse", handles=(handle,),
                             fds=[fd])
        with anyio.fail_after(TIMEOUT):
            async with honest_engine(fresh_sidecar) as (client, tokens):
                with peer(fresh_sidecar) as attacker:
                    reply, watch = await under_attack(
                        fresh_sidecar, client, tokens, in_thread(lambda: attacker.call(frame)))
                    await anyio.sleep(0.3)
                    watch.sample()
            after = await serves_byte_exact(fresh_sidecar)
    finally:
        os.close(fd)
    figures = assert_contained(fresh_sidecar, watch, reply, after, error_reply=False)
    assert watch.growth("VmRSS") < 256 * MiB, figures


@pytest.mark.parametrize("field", ["model", "cache_prefix"])
async def test_a_long_model_name_cannot_grow_memory(
    sidecar: SidecarProcess, field: str
) -> None:
    """A registration whose layout carries a 2 MiB model name (or cache_prefix) is
    refused."""
    engine = KVEngine(HONEST_LAYOUT)
    frame = registration(engine, f"long-{field}",
                         layout={**HONEST_LAYOUT, field: "m" * (2 * MiB)})
    with anyio.fail_after(TIMEOUT):
        async with honest_engine(sidecar) as (client, tokens):
            with peer(sidecar) as attacker:
                reply, watch = await under_attack(
                    sidecar, client, tokens, in_thread(lambda: attacker.call(frame)))
                if not isinstance(reply, ErrorReply):
                    attacker.call(Unregister(1), timeout_s=5)
        after = await serves_byte_exact(sidecar)
    assert_contained(sidecar, watch, reply, after)


async def test_an_explanation_of_a_million_hashes_is_refused(sidecar: SidecarProcess) -> None:
    """An unregistered peer asking to explain a million block hashes (no tokens) is
    refused at once, without holding up anyone's lookups."""
    frame = encode(Explain(1, block_hashes=(b"\x01",) * 1_000_000))
    reply, watch, after = await frame_attack(sidecar, frame)
    figures = assert_contained(sidecar, watch, reply, after)
    assert watch.growth("RssAnon") < 256 * MiB, figures


async def test_a_layout_of_millions_of_ranks_is_refused(sidecar: SidecarProcess) -> None:
    """A lookup-only registration claiming two million tensor-parallel ranks (each
    lookup would spell a key per rank and block) is refused as a bad layout."""
    engine = KVEngine(HONEST_LAYOUT)
    frame = msgspec.structs.replace(
        registration(engine, "ranks", handles=(),
                     layout={**HONEST_LAYOUT, "tp_size": 2_000_000}), lookup_only=True)
    reply, watch, after = await frame_attack(sidecar, frame)
    figures = assert_contained(sidecar, watch, reply, after)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_layout", figures


async def test_a_sliding_window_lookup_costs_time_linear_in_its_prompt(
    fresh_sidecar: SidecarProcess,
) -> None:
    """An engine of one-token sliding-window blocks with a window as long as any prompt
    stores a thousand blocks, then looks up the longest prompt it may: answered without
    walking the window anew for every candidate hit."""
    layout = {"model": "window", "groups": [{
        "kind": "sliding_window", "block_size": 1, "sliding_window": 1 << 30,
        "layers": ["attn.0"], "page_bytes": 64}]}
    engine = KVEngine(layout, num_blocks=1024)
    count = 65_536
    hashes = tuple(i.to_bytes(8, "little") for i in range(count))
    with anyio.fail_after(TIMEOUT):
        async with honest_engine(fresh_sidecar) as (client, tokens), \
                await EngineClient.connect(fresh_sidecar.endpoint, layout=engine.layout,
                                           kv_caches=engine.kv_caches, hash_algo="xxhash",
                                           block_hasher=lambda t, size: [bytes(8)] * len(t),
                                           timeout_s=20) as attacker:
            await attacker.save("seed", [7] * 1000, [list(range(1, 1001))],
                                block_hashes=hashes[:1000])

            async def attack() -> object:
                return await attacker.lookup([7] * count, block_hashes=hashes)

            reply, watch = await under_attack(fresh_sidecar, client, tokens, attack)
        after = await serves_byte_exact(fresh_sidecar)
    assert_contained(fresh_sidecar, watch, reply, after, error_reply=False)


async def test_large_request_keys_are_remembered_by_digest(sidecar: SidecarProcess) -> None:
    """Lookups carrying the largest request keys the wire takes (4096 multimodal items of
    long ids), three hundred times over, leave the sidecar's memory where it was."""
    engine = KVEngine(HONEST_LAYOUT)
    items = tuple((f"{index:04d}" + "m" * 250, 0, 1) for index in range(4096))
    prompt = random_tokens(64, seed=next(SEEDS))
    with anyio.fail_after(TIMEOUT):
        async with honest_engine(sidecar) as (client, tokens), \
                await engine.connect(sidecar.endpoint, timeout_s=20) as attacker:
            async def attack() -> object:
                for round_ in range(300):
                    await attacker.lookup(prompt, request_id=f"keys-{round_}",
                                          mm_items=items)
                return "done"

            reply, watch = await under_attack(sidecar, client, tokens, attack)
        after = await serves_byte_exact(sidecar)
    figures = assert_contained(sidecar, watch, reply, after, error_reply=False)
    assert watch.growth("RssAnon") < 128 * MiB, figures


async def test_an_engine_of_a_thousand_memory_files_does_not_lock_others_out(
    fresh_sidecar: SidecarProcess,
) -> None:
    """An engine registering a thousand memory files (the sidecar then holds descriptors
    past select's limit) leaves the next engines able to register, save and load; one
    handing over more files than an engine may map is refused by name."""
    many = {"model": "many", "groups": [{
        "kind": "full_attention", "block_size": 16, "page_bytes": 4096,
        "layers": [f"l.{index}" for index in range(1000)]}]}
    too_many = {**many, "groups": [{**many["groups"][0],
                                    "layers": [f"l.{index}" for index in range(1100)]}]}
    with anyio.fail_after(TIMEOUT):
        wide = KVEngine(many, num_blocks=1)
        async with await wide.connect(fresh_sidecar.endpoint, timeout_s=20):
            wider = KVEngine(too_many, num_blocks=1)
            fds = [segment for layer, tensor in wider.kv_caches.items()
                   for segment in _files_of(layer, tensor)]
            with peer(fresh_sidecar) as attacker:
                try:
                    refused: object = attacker.call(handed_over(
                        attacker.socket, registration(wide, "wider", handles=()), fds))
                except TransportError as exc:
                    refused = exc
            del wider
            after = await serves_byte_exact(fresh_sidecar)
    assert isinstance(refused, TransportError), describe(refused)
    assert "at most 1024 memory files" in str(refused), describe(refused)
    assert after == "ok", after


def _files_of(layer: str, tensor: Any) -> list[int]:
    """The descriptors of ``tensor``'s memory files."""
    segments = Segments()
    tensor_handle(layer, tensor, segments)
    return segments.fds


async def test_frames_over_the_limit_are_dropped_at_the_socket() -> None:
    """Fifty 1 MiB frames and fifty of 250 KiB from one peer that never reads, against a
    64 KiB frame limit, grow the sidecar's memory by next to nothing; it keeps serving."""
    with run_sidecar_process({"server": {"max_frame_bytes": 64 * 1024}}) as sidecar:
        frames = [b"\xc4" + os.urandom(MiB), b"\xc4" + os.urandom(250 * 1024)]

        def attack(attacker: Peer) -> None:
            for frame in frames:
                for _ in range(50):
                    attacker.send(frame)
            time.sleep(1.0)  # what gets through is taken in meanwhile

        reply, watch, after = await peer_attack(sidecar, attack)
        figures = assert_contained(sidecar, watch, reply, after, error_reply=False)
        assert watch.growth("RssAnon") < 32 * MiB, figures


async def test_messages_of_many_parts_are_refused_not_joined() -> None:
    """Messages of hundreds of parts, each under the frame limit, are refused one by one
    with an error reply, never joined into one frame: the sidecar's memory stays put."""
    with run_sidecar_process({"server": {"max_frame_bytes": 64 * 1024}}) as sidecar:
        part = b"\xc4" + os.urandom(60 * 1024)

        def attack(attacker: Peer) -> list[SidecarMessage | None]:
            replies = []
            for _ in range(5):
                attacker.socket.send_multipart([part] * 400)
                replies.append(attacker.recv(timeout_s=10))
            return replies

        replies, watch, after = await peer_attack(sidecar, attack)
        figures = assert_contained(sidecar, watch, replies, after, error_reply=False)
        assert isinstance(replies, list), figures
        assert all(isinstance(r, ErrorReply) and r.code == "bad_frame" for r in replies), (
            figures, replies)
        assert watch.growth("RssAnon") < 96 * MiB, figures


async def test_a_failure_inside_the_sidecar_costs_only_its_request() -> None:
    """Saves and loads failing inside the sidecar once accepted (an injected bug) are
    each answered exactly once, every block failed as internal and nothing loaded; the
    failures are counted, the engine's save credits come back, and it goes on saving and
    loading byte-exact."""
    overrides = {"faults": {"seed": 3, "points": {"receive.accepted": {"error_rate": 0.5}}},
                 "stages": {"receive": {"max_saves_per_engine": 2}}}
    with run_sidecar_process(overrides, metrics=True, allow_internal=True) as sidecar:
        engine = KVEngine(HONEST_LAYOUT)
        saves, loads = [], []
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint, timeout_s=10) as client:
                for index in range(20):
                    tokens = random_tokens(32, seed=index)
                    saves.append(await client.save(f"s{index}", tokens, [[1, 2], [3], [1, 2]]))
                    loads.append(await client.load(f"l{index}", tokens, [[4, 5], [6], [4, 5]],
                                                   32))
        internal = [r for r in [*saves, *loads]
                    if any(b.reason == "internal" for b in r.blocks)]
        assert 0 < len(internal) < 40
        for result in internal:
            assert all(b.status == "failed" and b.reason == "internal" for b in result.blocks)
        for result in loads:
            if any(b.reason == "internal" for b in result.blocks):
                assert result.loaded_tokens == 0 and set(result.invalid_block_ids) == {4, 5}
        counted = {s.name: s.value for s in sidecar.metrics()}
        assert counted["kvsidecar_internal_errors_total"] == len(internal)
        assert counted["kvsidecar_open_jobs"] == 0
        assert sidecar.process.poll() is None
        assert "server.request.internal" in sidecar.log()


async def test_peers_past_the_cap_are_refused_at_their_handshake() -> None:
    """With ``server.max_peers`` connections live, one more is refused at its handshake
    (nothing it sends is read); once one of them goes, a new one is let in."""
    with run_sidecar_process({"server": {"max_peers": 2}}) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with honest_engine(sidecar) as (client, tokens):
                with peer(sidecar, "second") as second:
                    assert isinstance(second.call(Heartbeat(1), timeout_s=5), ErrorReply)
                    with peer(sidecar, "third") as third:
                        assert third.call(Heartbeat(2), timeout_s=2) is None
                    assert await client.lookup(tokens) == 64
                with peer(sidecar, "fourth") as fourth:
                    # The second's disconnect reaches the count as the next one asks.
                    reply = fourth.call(Heartbeat(3), timeout_s=5)
                assert isinstance(reply, ErrorReply) and reply.code == "not_registered"
        assert sidecar.process.poll() is None
        assert "too many peers" in sidecar.log()


# -- random frames -----------------------------------------------------------------------

EXTREME_INTS = [0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -(2**63)]
HUGE = 200_000
wrong_types = st.sampled_from([None, True, 1.5, float("nan"), float("inf"), "", "x", b"",
                               [], {}, {"kind": "x"}, [[]], ["a", 1, None]])
long_strings = st.builds(lambda n, c: c * n, st.sampled_from([0, 1, 300, MiB]),
                         st.sampled_from(["x", "@", "é"]))
long_bytes = st.builds(lambda n, b: bytes([b]) * n, st.sampled_from([0, 1, 3, 4, 32, 4 * HUGE]),
                       st.sampled_from([0, 0xFF]))


def replacement(original: Any) -> st.SearchStrategy[Any]:
    """An extreme value of the same type as ``original`` (most often), or of another."""
    same: st.SearchStrategy[Any]
    if isinstance(original, bool):
        same = st.booleans()
    elif isinstance(original, int):
        same = st.sampled_from(EXTREME_INTS)
    elif isinstance(original, str):
        same = long_strings
    elif isinstance(original, bytes):
        same = long_bytes
    elif isinstance(original, list):
        first = original[0] if original else 1
        same = st.one_of(st.just([]), st.builds(lambda n: [first] * n, st.sampled_from([2, HUGE])),
                         st.lists(st.sampled_from(EXTREME_INTS), min_size=1, max_size=4))
    else:
        same = st.just({})
    return st.one_of(same, same, same, wrong_types)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a decoded frame a value could be replaced (never its kind)."""
    if path:
        yield path
    if isinstance(node, dict):
        for key, value in node.items():
            if path or key != "kind":
                yield from _paths(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node[:4]):
            yield from _paths(value, (*path, index))


def _mutated(template: dict[str, Any], changes: list[tuple[tuple[Any, ...], Any]]) -> bytes:
    frame = copy.deepcopy(template)
    for path, value in changes:
        node = frame
        try:
            for step in path[:-1]:
                node = node[step]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change replaced what this one lies in
    return msgspec.msgpack.encode(frame)


@pytest.fixture(scope="module")
def fuzz_sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process() as process:
        yield process


def test_random_frames_from_any_peer_cost_only_an_error_reply(
    fuzz_sidecar: SidecarProcess,
) -> None:
    """Frames of every engine message kind with extreme and inconsistent values, from an
    unregistered peer or a registered one, each get one reply; the sidecar lives and an
    honest engine's lookup is answered within a second throughout."""
    sidecar = fuzz_sidecar
    honest_kv, attacker_kv = KVEngine(HONEST_LAYOUT), KVEngine(HONEST_LAYOUT)
    tokens = random_tokens(4 * 16 + 1, seed=next(SEEDS))
    blocks = ((1, 2, 3, 4), (5,), (1, 2, 3, 4))
    with peer(sidecar, "honest") as honest, peer(sidecar, "registered") as insider, \
            peer(sidecar, "stranger") as stranger:
        honest_id = honest.socket.getsockopt(zmq.IDENTITY).decode()
        assert isinstance(honest.call(registration(honest_kv, honest_id)), Registered)
        enrol = registration(attacker_kv, "insider")
        assert isinstance(insider.call(enrol), Registered)
        packed = pack_tokens(tokens)
        messages: list[EngineMessage] = [
            enrol, Heartbeat(1), Lookup(1, packed), Explain(1, honest_id, packed),
            Save(1, "fuzz", packed, blocks), Load(1, "fuzz", packed, blocks, 64),
            Unregister(1),
        ]
        templates = [msgspec.msgpack.decode(encode(message)) for message in messages]
        paths = {index: list(_paths(template)) for index, template in enumerate(templates)}
        seq = itertools.count(1)

        @settings(max_examples=200, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(data=st.data(), registered=st.booleans(),
               kind=st.integers(0, len(templates) - 1))
        def one_frame(data: st.DataObject, registered: bool, kind: int) -> None:
            changes = []
            for _ in range(data.draw(st.integers(1, 3))):
                path = data.draw(st.sampled_from(paths[kind]))
                node = templates[kind]
                for step in path:
                    node = node[step]
                changes.append((path, data.draw(replacement(node))))
            attacker = insider if registered else stranger
            attacker.send(_mutated(templates[kind], changes))
            started = time.monotonic()
            number = next(seq)
            honest.send(Lookup(number, packed))
            answer = honest.recv(timeout_s=5)
            wait = time.monotonic() - started
            reply = attacker.recv(timeout_s=20)
            figures = (f"sidecar exit status {sidecar.process.poll()}; honest lookup "
                       f"{describe(answer)} after {wait:.2f}s; attacker's reply "
                       f"{describe(reply)}")
            assert sidecar.process.poll() is None, figures
            assert isinstance(answer, LookupReply) and answer.seq == number, figures
            assert wait < LIVENESS_S, figures
            assert reply is not None, figures
            if attacker is insider and isinstance(reply, Unregistered):
                assert isinstance(insider.call(enrol), Registered)
            if attacker is stranger and isinstance(reply, Registered):
                stranger.call(Unregister(1))

        one_frame()
    after = anyio.run(serves_byte_exact, sidecar)  # bounded by its own fail_after
    assert after == "ok", after
