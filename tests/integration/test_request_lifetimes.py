"""A request the engine gave up on never touches its memory again, against live
sidecars stalled with SIGSTOP (as GC, CPU starvation or a slow store would stall them).

Each engine here keeps the contract the client gives it: once a save or load call is
over (returned or raised), its blocks are the engine's to reuse. Afterwards every block
must hold what the engine last wrote, and every stored value the true KV of its key.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import anyio
import pytest
import torch

from pipeline.core.errors import TransportError
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import KVEngine, engine_process, mapped_kv, random_tokens
from transport.client import LoadResult, SaveResult

LAYOUT = {"model": "lifetimes", "groups": [
    {"kind": "full_attention", "block_size": 16, "layers": ["l0", "l1"], "page_bytes": 4096}]}
TIMEOUT = 60.0
GIVE_UP_S = 0.5
"""The engine's timeout: it gives up on a request after this long."""
STALL_S = 2.0
"""How long the sidecar is stopped: well past the engine's timeout."""


def fill(engine: KVEngine, block_ids: list[int], byte: int) -> None:
    """The engine writes ``byte`` over every page of the blocks (new KV)."""
    for tensor in engine.kv_caches.values():
        for block in block_ids:
            tensor[block].view(torch.uint8).fill_(byte)


def holds(engine: KVEngine, block_ids: list[int], byte: int) -> bool:
    return all(bool((tensor[block_ids].view(torch.uint8) == byte).all())
               for tensor in engine.kv_caches.values())


@contextlib.contextmanager
def stopped(sidecar: SidecarProcess) -> Iterator[None]:
    """The sidecar stopped while inside (and on any way out, running again)."""
    os.kill(sidecar.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sidecar.pid, signal.SIGCONT)


async def resume_after(sidecar: SidecarProcess, delay_s: float) -> None:
    await anyio.sleep(delay_s)
    os.kill(sidecar.pid, signal.SIGCONT)


async def test_a_load_given_up_on_never_writes_the_engines_blocks() -> None:
    """The engine loads a stored prompt into blocks 5-6 with a short timeout while the
    sidecar is stopped, and writes its own KV (``N``) into them once the call is over.
    When the sidecar resumes, the stored bytes (``O``) never land over them."""
    engine = KVEngine(LAYOUT)
    tokens = random_tokens(3 * 16, seed=1)
    fill(engine, [1, 2, 3], ord("O"))
    outcome: LoadResult | TransportError | None = None
    with run_sidecar_process() as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                assert (await client.save("p", tokens, [[1, 2, 3]])).stored == 3
                started = time.monotonic()
                with stopped(sidecar):
                    async with anyio.create_task_group() as group:
                        group.start_soon(resume_after, sidecar, STALL_S)
                        try:
                            outcome = await client.load("l", tokens, [[5, 6, 7]], 32,
                                                        timeout_s=GIVE_UP_S)
                        except TransportError as exc:
                            outcome = exc
                        over_after = time.monotonic() - started
                        fill(engine, [5, 6], ord("N"))  # the call is over: blocks reused
                await client.heartbeat()  # the sidecar has caught up
                await anyio.sleep(0.5)
                await client.heartbeat()
    figures = f"the load call was over after {over_after:.2f} s: {outcome!r}"
    print(figures)
    assert holds(engine, [5, 6], ord("N")), f"the sidecar overwrote reused blocks; {figures}"
    assert isinstance(outcome, LoadResult) and outcome.loaded_tokens == 0, figures
    assert over_after >= STALL_S - 0.1, figures
    assert {block.reason for block in outcome.blocks} == {"deadline"}, figures


async def test_a_save_given_up_on_never_stores_what_the_engine_wrote_after() -> None:
    """The engine saves prompt P (its KV ``P``) with a short timeout while the sidecar is
    stopped, then writes other KV (``Z``) into the same blocks once the call is over.
    After the sidecar resumes, a fresh engine loading P gets P's KV or nothing: the
    store never holds ``Z`` under P's keys."""
    engine, fresh = KVEngine(LAYOUT), KVEngine(LAYOUT)
    tokens = random_tokens(4 * 16, seed=2)
    fill(engine, [1, 2, 3, 4], ord("P"))
    outcome: SaveResult | TransportError | None = None
    with run_sidecar_process() as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                started = time.monotonic()
                with stopped(sidecar):
                    async with anyio.create_task_group() as group:
                        group.start_soon(resume_after, sidecar, STALL_S)
                        try:
                            outcome = await client.save("p", tokens, [[1, 2, 3, 4]],
                                                        timeout_s=GIVE_UP_S)
                        except TransportError as exc:
                            outcome = exc
                        over_after = time.monotonic() - started
                        fill(engine, [1, 2, 3, 4], ord("Z"))  # blocks reused
                await client.heartbeat()
                await anyio.sleep(0.5)
                await client.heartbeat()
            async with await fresh.connect(sidecar.endpoint) as other:
                hit = await other.lookup(tokens)
                loaded = await other.load("again", tokens, [[9, 10, 11, 12]], hit)
    figures = (f"the save call was over after {over_after:.2f} s: {outcome!r}; a fresh "
               f"engine then hit {hit} tokens and loaded {loaded.loaded_tokens}")
    print(figures)
    blocks = [9, 10, 11, 12][: loaded.loaded_tokens // 16]
    assert not blocks or holds(fresh, blocks, ord("P")), f"the store held Z: {figures}"
    assert isinstance(outcome, SaveResult) and outcome.stored == 0, figures
    assert hit == 0, figures


async def test_a_cancelled_save_is_answered_at_once_and_stores_nothing() -> None:
    """A save held before its copy (a slow transfer) past the engine's timeout is
    cancelled: the engine has its answer about when it gave up, every block skipped as
    cancelled, not after the stall; nothing of it is stored later, and the metrics
    count the cancel."""
    engine = KVEngine(LAYOUT)
    tokens = random_tokens(4 * 16, seed=3)
    overrides = {"faults": {"points": {"stage.transfer": {"delay_ms": 2000}}}}
    with run_sidecar_process(overrides, metrics=True) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                started = time.monotonic()
                saved = await client.save("p", tokens, [[1, 2, 3, 4]], timeout_s=GIVE_UP_S)
                answered_after = time.monotonic() - started
                await anyio.sleep(2.5)  # the held save has reached its copy
                hit = await client.lookup(tokens)
                samples = await anyio.to_thread.run_sync(sidecar.metrics)
    figures = f"answered after {answered_after:.2f} s: {saved}; then hit {hit}"
    print(figures)
    assert answered_after < 1.5, figures
    assert saved.skipped == 4 and {b.reason for b in saved.blocks} == {"cancelled"}, figures
    assert hit == 0, figures
    counted = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert counted[("kvsidecar_cancels_total", (("request", "open"),))] == 1
    assert counted[("kvsidecar_blocks_total", (("path", "save"), ("reason", "cancelled"),
                                               ("status", "skipped")))] == 4


async def test_a_request_held_by_a_sidecar_that_dies_is_released() -> None:
    """A sidecar stopped with a save in flight, then killed: the engine's call, waiting
    for the cancel's answer, ends as soon as the endpoint's lock is free (the sidecar
    cannot touch the blocks any more), not on a timer."""
    engine = KVEngine(LAYOUT)
    tokens = random_tokens(2 * 16, seed=4)
    with run_sidecar_process() as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                os.kill(sidecar.pid, signal.SIGSTOP)
                started = time.monotonic()
                async with anyio.create_task_group() as group:
                    async def kill_later() -> None:
                        await anyio.sleep(STALL_S)
                        os.kill(sidecar.pid, signal.SIGKILL)

                    group.start_soon(kill_later)
                    with pytest.raises(TransportError, match="no longer touches"):
                        await client.save("p", tokens, [[1, 2]], timeout_s=GIVE_UP_S)
                released_after = time.monotonic() - started
                assert client.held == 0
                await client.aclose()
    print(f"released {released_after - STALL_S:.2f} s after the sidecar was killed")
    assert STALL_S <= released_after < STALL_S + 2.0


def test_a_second_sidecar_on_a_live_endpoint_refuses_to_start() -> None:
    """A sidecar holds its endpoint's lock for life: a second one on the same endpoint
    (say, started while the first is stalled) refuses to start, naming the lock, and the
    first keeps its socket and serves on."""
    with run_sidecar_process() as first:
        with stopped(first), pytest.raises(RuntimeError, match="another sidecar holds"), \
                run_sidecar_process({"server": {"endpoint": first.endpoint}}):
            pass
        engine = KVEngine(LAYOUT)

        async def still_serves() -> int:
            async with await engine.connect(first.endpoint) as client:
                return (await client.save("p", random_tokens(32, seed=5), [[1, 2]])).stored

        assert anyio.run(still_serves) == 2


async def test_a_block_written_during_its_save_is_never_stored_torn() -> None:
    """An engine that breaks the fence: it writes one block of a save while the save's
    copy is held (fault point ``transfer.copied``, after the copy and before its check).
    What was copied may be torn: the save reports that block changed and stores none of
    the batch, and a fresh engine finds nothing of the prompt."""
    engine, fresh = KVEngine(LAYOUT), KVEngine(LAYOUT)
    tokens = random_tokens(4 * 16, seed=6)
    fill(engine, [1, 2, 3, 4], ord("P"))
    overrides = {"faults": {"points": {"transfer.copied": {"delay_ms": 1000}}}}
    with run_sidecar_process(overrides) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                saved: list[SaveResult] = []
                async with anyio.create_task_group() as group:
                    async def save() -> None:
                        saved.append(await client.save("p", tokens, [[1, 2, 3, 4]]))

                    group.start_soon(save)
                    await anyio.sleep(0.5)  # copied, held before its check
                    fill(engine, [3], ord("Z"))
            async with await fresh.connect(sidecar.endpoint) as other:
                hit = await other.lookup(tokens)
    reasons = {block.block_id: block.reason for block in saved[0].blocks}
    print(f"the save answered {reasons}; a fresh engine then hit {hit} tokens")
    assert reasons[3] == "changed_during_copy", reasons
    assert saved[0].stored == 0 and hit == 0, reasons


async def test_a_shutdown_answers_a_save_only_once_its_copy_has_returned() -> None:
    """A shutdown whose drain runs out while a save's copy is held (fault point
    ``transfer.copied``) stops the save, as a cancel does: its answer comes only once the
    copy has returned, and stores nothing of what the copy read."""
    engine = KVEngine(LAYOUT)
    tokens = random_tokens(4 * 16, seed=7)
    fill(engine, [1, 2, 3, 4], ord("P"))
    overrides = {"faults": {"points": {"transfer.copied": {"delay_ms": 1500}}},
                 "server": {"drain_timeout_s": 0.2}}
    outcome: SaveResult | TransportError | None = None
    with run_sidecar_process(overrides) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                started = time.monotonic()
                async with anyio.create_task_group() as group:
                    async def save() -> None:
                        nonlocal outcome
                        try:
                            outcome = await client.save("p", tokens, [[1, 2, 3, 4]])
                        except TransportError as exc:
                            outcome = exc

                    group.start_soon(save)
                    await anyio.sleep(0.5)  # copied, held before its check
                    os.kill(sidecar.pid, signal.SIGTERM)
                answered_after = time.monotonic() - started
        log = sidecar.final_log()
    figures = f"answered after {answered_after:.2f} s: {outcome!r}"
    print(figures)
    assert answered_after >= 1.4, f"answered while its copy was held; {figures}\n{log}"
    assert isinstance(outcome, SaveResult) and outcome.stored == 0, figures


REAPED_ENGINE = """
import sys, anyio
from tests.kit import KVEngine, random_tokens
from tests.integration.test_request_lifetimes import LAYOUT, fill

async def main():
    engine = KVEngine(LAYOUT)
    fill(engine, [1, 2, 3, 4], ord("P"))
    async with await engine.connect(sys.argv[1]) as client:
        print("registered", flush=True)
        await client.save("p", random_tokens(4 * 16, seed=8), [[1, 2, 3, 4]])

anyio.run(main)
"""


def test_an_engine_killed_while_its_save_is_copied_is_unmapped_only_after_the_copy() -> None:
    """An engine SIGKILLed while its save's copy is held is reaped at once, but its
    memory stays mapped until the copy returns; the save is then stopped, nothing of it
    is stored, and the sidecar serves on."""
    overrides = {"faults": {"points": {"transfer.copied": {"delay_ms": 2500}}}}
    with run_sidecar_process(overrides) as sidecar:
        with engine_process(REAPED_ENGINE, sidecar.endpoint) as engine:
            time.sleep(0.5)  # its save copied, held before its check
            mapped = mapped_kv(sidecar.pid)
            assert mapped, "the engine's memory should be mapped"
            engine.kill()
            engine.wait()
            sidecar.wait_log(lambda log: '"session.owner_exited"' in log, 5.0)
            held_while_copying = mapped_kv(sidecar.pid) & mapped
            deadline = time.monotonic() + 15
            while mapped_kv(sidecar.pid) & mapped:
                assert time.monotonic() < deadline, "the mapping was never released"
                time.sleep(0.1)
        assert held_while_copying, "unmapped while a copy of it was in flight"

        async def fresh_engine() -> tuple[int, int]:
            fresh = KVEngine(LAYOUT)
            with anyio.fail_after(TIMEOUT):
                async with await fresh.connect(sidecar.endpoint) as client:
                    hit = await client.lookup(random_tokens(4 * 16, seed=8))
                    saved = await client.save("q", random_tokens(2 * 16, seed=9), [[1, 2]])
            return hit, saved.stored

        assert anyio.run(fresh_engine) == (0, 2)
