"""Sidecars on a real Mooncake cluster (a real mooncake_master on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import psutil
import pytest
import pytest_asyncio
import torch
from rich.console import Console

from pipeline.app.status import Snapshot, render
from pipeline.backends.stores.mooncake.master import EmbeddedMaster, open_embedded_master
from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.outcomes import BlockStatus
from pipeline.testing import run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens, stall_proxy

pytestmark = pytest.mark.mooncake

MIB = 1024 * 1024
TIMEOUT = 60
STAGING = {"pool_bytes": 16 * MIB, "slot_bytes": 1 * MIB, "load_slots": 4}


def mooncake_overrides(master: EmbeddedMaster | None = None, *,
                       in_place: bool = True) -> dict[str, Any]:
    mooncake: dict[str, Any] = {"global_segment_bytes": 64 * MIB,
                                "local_buffer_bytes": 16 * MIB, "in_place": in_place}
    if master is not None:
        mooncake["master"] = master.endpoints.master_address
        mooncake["metadata_server"] = master.endpoints.metadata_server
    return {"store": {"backend": "mooncake", "mooncake": mooncake}, "staging": STAGING}


@pytest_asyncio.fixture
async def master() -> AsyncIterator[EmbeddedMaster]:
    with anyio.fail_after(30):
        started = await open_embedded_master(MooncakeStoreConfig())
    async with started:
        yield started


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staging"])
async def test_save_lookup_load_through_a_sidecar_on_mooncake_is_byte_exact(
    in_place: bool,
) -> None:
    """With its own embedded master, a sidecar stores, dedups, finds and loads exactly,
    values moved in place or through staging; on SIGTERM it stops the master too, and
    engine memory registered with Mooncake is unregistered as each engine leaves. In
    place, the load reads every value where it lies in the sidecar's own segment, as
    its metrics say."""
    layout = hybrid_layout(page_bytes=8192)
    writer, reader = KVEngine(layout), KVEngine(layout)
    tokens = random_tokens(4 * 16 + 3, seed=21)
    with run_sidecar_process(mooncake_overrides(in_place=in_place), metrics=True) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await writer.connect(sidecar.endpoint) as a, \
                    await reader.connect(sidecar.endpoint) as b:
                first = await a.save("w", tokens, [[1, 2, 3, 4, 5], [6], [1, 2, 3, 4, 5]])
                again = await a.save("w2", tokens, [[1, 2, 3, 4, 5], [6], [1, 2, 3, 4, 5]])
                hit = await b.lookup(tokens)
                loaded = await b.load("r", tokens, [[11, 12, 13, 14, 15], [9],
                                                   [21, 22, 23, 24, 25]], hit)
            samples = await anyio.to_thread.run_sync(sidecar.metrics)
        read_here = {sample.labels["outcome"]: sample.value for sample in samples
                     if sample.name == "kvsidecar_store_values_read_here_total"}
        masters = [p for p in psutil.Process(sidecar.pid).children(recursive=True)
                   if "mooncake_master" in p.name()]
        assert masters, "the sidecar should run its own master"
        log = sidecar.final_log()
        assert sidecar.terminate() == 0, log
    registered = log.count("store.mooncake.memory.registered")
    assert registered == (8 if in_place else 0)  # two engines, each 4 stored layers
    assert log.count("store.mooncake.memory.unregistered") == registered
    assert (first.stored, first.failed) == (8, 0)
    assert (again.present, again.stored) == (8, 0)
    assert hit == 64 and loaded.loaded_tokens == 64 and not loaded.invalid_block_ids
    assert all(writer.same_block(0, 1 + j, reader, 11 + j) for j in range(4))
    assert writer.same_block(2, 4, reader, 24)
    loaded_blocks = sum(1 for block in loaded.blocks if block.status is BlockStatus.LOADED)
    assert read_here == {"loaded": loaded_blocks if in_place else 0, "lease_expired": 0}
    console = Console(record=True, width=120)
    console.print(render(Snapshot(samples)))
    assert (f"values loads read where they lie │ {loaded_blocks if in_place else 0} "
            "(0 failed, past their lease)") in console.export_text()
    for process in masters:
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("writer_in_place", [True, False], ids=["in-place-writer",
                                                                "staging-writer"])
async def test_two_sidecars_share_blocks_through_one_mooncake_cluster(
    master: EmbeddedMaster, writer_in_place: bool,
) -> None:
    """Scale-out: engine A saves through sidecar A, engine B loads the same prefix byte
    for byte through sidecar B; each sidecar contributes its own segment to one master.
    One moves values in place, the other through staging: the values are the same bytes."""
    layout = hybrid_layout(page_bytes=8192)
    engine_a, engine_b = KVEngine(layout), KVEngine(layout)
    tokens = random_tokens(3 * 16 + 1, seed=22)
    with run_sidecar_process(mooncake_overrides(master, in_place=writer_in_place)) \
            as sidecar_a, \
            run_sidecar_process(mooncake_overrides(master, in_place=not writer_in_place)) \
            as sidecar_b:
        with anyio.fail_after(TIMEOUT):
            async with await engine_a.connect(sidecar_a.endpoint) as a, \
                    await engine_b.connect(sidecar_b.endpoint) as b:
                saved = await a.save("a", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
                hit = await b.lookup(tokens)
                loaded = await b.load("b", tokens, [[31, 32, 33, 34], [7],
                                                   [41, 42, 43, 44]], hit)
    assert saved.stored == 6
    assert hit == 48 and loaded.loaded_tokens == 48 and not loaded.invalid_block_ids
    assert all(engine_a.same_block(0, 1 + j, engine_b, 31 + j) for j in range(3))
    assert engine_a.same_block(2, 3, engine_b, 43)


async def test_a_full_mooncake_store_skips_saves_and_keeps_serving(
    master: EmbeddedMaster,
) -> None:
    """Saves beyond the cluster's memory come back skipped(store_full) — under pressure
    without even being copied — never failed, and the sidecar keeps answering."""
    layout = hybrid_layout(page_bytes=256 * 1024)  # 1 MiB per stored block
    engine = KVEngine(layout)
    overrides = mooncake_overrides(master)
    overrides["store"]["mooncake"]["global_segment_bytes"] = 16 * MIB
    results = []
    with run_sidecar_process(overrides) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint) as client:
                for index in range(12):  # 12 requests x 8 blocks x 1 MiB >> 16 MiB
                    first = 1 + (index % 7) * 8
                    ids = list(range(first, first + 8))
                    results.append(await client.save(
                        f"r{index}", random_tokens(8 * 16, seed=500 + index), [ids, [63], ids]))
                # Still serving, and still by the hit rule: aligned, last token excluded.
                hit = await client.lookup(random_tokens(8 * 16, seed=500))
                assert hit % 16 == 0 and hit <= 7 * 16
    reasons = {b.reason for r in results for b in r.blocks if b.status == "skipped"}
    assert "store_full" in reasons, reasons
    for result in results:
        assert result.failed == 0
        assert result.stored + result.present + result.skipped == 16


async def stored_once_back(client: Any) -> int:
    """Save fresh requests until the store takes one again; how many blocks it stored."""
    for index in range(120):
        await anyio.sleep(0.25)
        result = await client.save(
            f"back-{index}", random_tokens(33, seed=100 + index), [[8, 9], [10], [8, 9]])
        if result.stored:
            return int(result.stored)
    return 0


async def test_mooncake_master_restart_is_survived_without_timeout_storms() -> None:
    """Master down: saves are skipped (store_unavailable) and lookups miss at once, not
    after timeouts. Master back on the same address: service resumes by itself."""
    import urllib.parse

    import msgspec

    base = MooncakeStoreConfig()
    first = await open_embedded_master(base)
    master_port = int(first.endpoints.master_address.rsplit(":", 1)[1])
    metadata_port = urllib.parse.urlsplit(first.endpoints.metadata_server).port
    overrides = mooncake_overrides(first)
    overrides["store"]["breaker"] = {"failure_threshold": 2, "reset_after_s": 0.5}
    engine = KVEngine(hybrid_layout(page_bytes=8192))
    restarted: EmbeddedMaster | None = None
    try:
        with run_sidecar_process(overrides) as sidecar:
            async with await engine.connect(sidecar.endpoint) as client:
                with anyio.fail_after(TIMEOUT):
                    tokens = random_tokens(2 * 16 + 1, seed=40)
                    assert (await client.save("up", tokens, [[1, 2], [3], [1, 2]])).stored == 4
                    await first.aclose()

                    outcomes = set()
                    started = anyio.current_time()
                    for index in range(6):
                        result = await client.save(
                            f"down-{index}", random_tokens(33, seed=41 + index),
                            [[5, 6], [7], [5, 6]])
                        outcomes |= {(b.status, b.reason) for b in result.blocks}
                        assert await client.lookup(tokens) == 0
                    assert ("skipped", "store_unavailable") in outcomes, outcomes
                    assert anyio.current_time() - started < 10  # no timeout storm

                    restarted = await open_embedded_master(msgspec.structs.replace(
                        base, master_port=master_port, metadata_port=metadata_port))
                    assert await stored_once_back(client) == 4
            assert sidecar.terminate() == 0
    finally:
        await first.aclose()
        if restarted is not None:
            await restarted.aclose()


async def test_a_hung_master_is_survived_and_service_resumes_by_itself(
    master: EmbeddedMaster,
) -> None:
    """Master hung (it stops answering; connections stay open): saves are answered
    without storing and lookups miss, within the call timeout and no storm of them; once
    the master answers again, the sidecar stores and hits again without a restart."""
    async with stall_proxy(master.endpoints.master_address) as (proxy, address):
        overrides = mooncake_overrides(master)
        overrides["store"]["mooncake"] |= {"master": address, "call_timeout_s": 1.0}
        overrides["store"]["breaker"] = {"failure_threshold": 2, "reset_after_s": 0.5}
        engine = KVEngine(hybrid_layout(page_bytes=8192))
        with run_sidecar_process(overrides) as sidecar:
            async with await engine.connect(sidecar.endpoint) as client:
                with anyio.fail_after(TIMEOUT):
                    tokens = random_tokens(2 * 16 + 1, seed=50)
                    assert (await client.save("up", tokens, [[1, 2], [3], [1, 2]])).stored == 4
                    hit = await client.lookup(tokens)
                    assert hit > 0

                    assert await proxy.command("stall") == "stalled"
                    started = anyio.current_time()
                    statuses = set()
                    for index in range(4):
                        result = await client.save(
                            f"hung-{index}", random_tokens(33, seed=51 + index),
                            [[5, 6], [7], [5, 6]])
                        statuses |= {block.status for block in result.blocks}
                        assert await client.lookup(tokens) == 0
                    assert statuses and "stored" not in statuses, statuses
                    assert anyio.current_time() - started < 10  # one timeout, then at once

                    assert await proxy.command("resume") == "resumed"
                    assert await stored_once_back(client) == 4
                    assert await client.lookup(tokens) == hit
            assert sidecar.terminate() == 0


async def test_a_block_removed_between_lookup_and_load_is_reported_failed() -> None:
    """Another client removes one block after the lookup: the load reports exactly that
    block id failed and no tokens usable past it; nothing else is touched."""
    import msgspec

    from pipeline.backends.stores.mooncake.setup import open_mooncake_store
    from pipeline.core.hashing import block_hashes
    from pipeline.core.keys import ValueFormat, keys_for, layout_keys
    from pipeline.core.layout import KVCacheLayout

    quick_leases = MooncakeStoreConfig(kv_lease_ttl_ms=100)
    async with await open_embedded_master(quick_leases) as master:
        layout = hybrid_layout(page_bytes=8192)
        writer, reader = KVEngine(layout), KVEngine(layout)
        tokens = random_tokens(3 * 16 + 1, seed=60)
        prefix = layout_keys(KVCacheLayout.from_dict(layout), ValueFormat.NATIVE)[0].own
        [victim] = keys_for(prefix, [block_hashes(tokens, 16)[1]])
        other = await open_mooncake_store(msgspec.structs.replace(
            quick_leases, master=master.endpoints.master_address,
            metadata_server=master.endpoints.metadata_server,
            global_segment_bytes=16 * MIB, local_buffer_bytes=0))
        async with other:
            with run_sidecar_process(mooncake_overrides(master)) as sidecar:
                with anyio.fail_after(TIMEOUT):
                    async with await writer.connect(sidecar.endpoint) as a, \
                            await reader.connect(sidecar.endpoint) as b:
                        await a.save("w", tokens, [[1, 2, 3, 4], [5], [1, 2, 3, 4]])
                        assert await b.lookup(tokens) == 48
                        removed = 0
                        while not removed:  # once the put's lease has expired
                            await anyio.sleep(0.05)
                            removed = await other.remove([victim])
                        loaded = await b.load("r", tokens, [[11, 12, 13, 14], [9],
                                                           [21, 22, 23, 24]], 48)
    assert loaded.invalid_block_ids == (12,)
    assert loaded.loaded_tokens == 0  # resuming needs block 1, and no earlier mamba state
    assert writer.same_block(0, 1, reader, 11) and writer.same_block(0, 3, reader, 13)


async def test_values_corrupted_at_rest_in_place_are_refused_and_dropped() -> None:
    """Values moved in place and corrupted as stored (in the checksum kept with them,
    never in the writer's memory) load as failed with checksum_mismatch, and are removed
    from the store so that a fresh save replaces them."""
    overrides = mooncake_overrides()
    overrides["faults"] = {"points": {"store.put": {"corrupt_rate": 1.0}}}
    layout = hybrid_layout(page_bytes=8192)
    writer, reader = KVEngine(layout), KVEngine(layout)
    tokens = random_tokens(2 * 16 + 1, seed=23)
    written = [writer.pages(0, 1), writer.pages(0, 2), writer.pages(2, 2)]
    with run_sidecar_process(overrides) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await writer.connect(sidecar.endpoint) as a, \
                    await reader.connect(sidecar.endpoint) as b:
                assert (await a.save("w", tokens, [[1, 2], [3], [1, 2]])).stored == 4
                assert await b.lookup(tokens) == 32
                loaded = await b.load("r", tokens, [[7, 8], [5], [7, 8]], 32)
                dropped = await b.lookup(tokens)
    assert loaded.loaded_tokens == 0
    assert sorted(loaded.invalid_block_ids) == [7, 8, 8]
    assert {r.reason for r in loaded.blocks} == {"checksum_mismatch"}
    assert dropped == 0
    after = [writer.pages(0, 1), writer.pages(0, 2), writer.pages(2, 2)]
    for pages_before, pages_after in zip(written, after, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(pages_before, pages_after, strict=True))
