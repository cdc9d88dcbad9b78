"""A sidecar with a disk tier restarts warm: engines hit again on what it saved before a
SIGTERM, and after a SIGKILL on every value that was durable, byte for byte."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from pipeline.core.events import external_hash
from pipeline.core.hashing import block_hashes
from pipeline.core.runs import value_span
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens

TIMEOUT = 60
MiB = 1 << 20
LAYOUT = hybrid_layout(page_bytes=16 * 1024)
TOKENS = 4 * 16 + 1  # four full blocks


def with_tier(path: Path, **store: Any) -> dict[str, Any]:
    return {"store": {"capacity_bytes": 64 * MiB,
                      "disk": {"path": str(path), "bytes": 256 * MiB}, **store}}


def blocks_of(index: int) -> list[list[int]]:
    """The engine blocks prompt ``index`` is saved from (and loaded into, at 40 on)."""
    first = 1 + (index % 9) * 4
    ids = list(range(first, first + 4))
    return [ids, [63], ids]


def prompt(index: int) -> list[int]:
    return random_tokens(TOKENS, seed=5000 + index)


async def load_and_check(sidecar: SidecarProcess, saver: KVEngine, indices: range,
                         layout: dict[str, Any] = LAYOUT) -> dict[int, int]:
    """Load each prompt into a fresh engine of ``layout``; the tokens each hit, after
    checking that every block loaded equals the block it was saved from."""
    reader = KVEngine(layout)
    hits = {}
    async with await reader.connect(sidecar.endpoint) as client:
        for index in indices:
            hit = await client.lookup(prompt(index))
            hits[index] = hit
            if not hit:
                continue
            into = [[40, 41, 42, 43], [62], [40, 41, 42, 43]]
            loaded = await client.load(f"load-{index}", prompt(index), into, hit)
            assert loaded.loaded_tokens == hit and not loaded.invalid_block_ids
            for j in range(hit // 16):
                assert reader.same_block(0, 40 + j, saver, blocks_of(index)[0][j]), (index, j)
    return hits


def written(sidecar: SidecarProcess) -> float:
    """Values the sidecar's disk tier holds as durable so far."""
    return sum(s.value for s in sidecar.metrics() if s.name == "kvsidecar_disk_writes_total")


async def test_a_restarted_sidecar_serves_what_it_saved(tmp_path: Path) -> None:
    """Save, stop the sidecar (SIGTERM: memory is flushed to disk), start another on the
    same tier: a new engine's lookups hit in full and its loads equal what was saved."""
    saver = KVEngine(LAYOUT)
    with anyio.fail_after(TIMEOUT):
        with run_sidecar_process(with_tier(tmp_path / "tier")) as first:
            async with await saver.connect(first.endpoint) as client:
                for index in range(8):
                    result = await client.save(f"save-{index}", prompt(index), blocks_of(index))
                    assert result.stored > 0 and not result.failed
            assert first.terminate() == 0
        with run_sidecar_process(with_tier(tmp_path / "tier")) as second:
            assert "store.disk.opened" in second.log()
            hits = await load_and_check(second, saver, range(8))
    assert hits == {index: 64 for index in range(8)}


async def test_after_a_sigkill_every_durable_value_survives(tmp_path: Path) -> None:
    """SIGKILL the sidecar while saves stream in. Every value durable before (the tier's
    count of writes covered it) loads after the restart, byte for byte: a hit rate of 1
    over them. Of the saves the kill cut off, whatever hits is equally exact. (A
    SIGKILL leaves the kernel's buffers to be written: a power loss, which would not,
    is the records' checksums' to catch.)"""
    saver = KVEngine(LAYOUT)
    with anyio.fail_after(TIMEOUT * 2):
        with run_sidecar_process(with_tier(tmp_path / "tier"), metrics=True) as first:
            async with await saver.connect(first.endpoint) as client:
                stored = 0
                for index in range(12):
                    stored += (await client.save(f"save-{index}", prompt(index),
                                                 blocks_of(index))).stored
                while written(first) < stored:  # noqa: ASYNC110
                    await anyio.sleep(0.05)

                async def stream(index: int) -> None:
                    await client.save(f"save-{index}", prompt(index), blocks_of(index))

                with anyio.move_on_after(5):
                    async with anyio.create_task_group() as tg:
                        for index in range(12, 40):
                            tg.start_soon(stream, index)
                        await anyio.sleep(0.2)
                        first.process.send_signal(signal.SIGKILL)
                        first.process.wait()
                        tg.cancel_scope.cancel()
        with run_sidecar_process(with_tier(tmp_path / "tier")) as second:
            durable = await load_and_check(second, saver, range(12))
            cut_off = await load_and_check(second, saver, range(12, 40))
    assert durable == {index: 64 for index in range(12)}
    assert len(cut_off) == 28  # each one that hit was checked byte for byte above


async def test_one_tier_belongs_to_one_sidecar(tmp_path: Path) -> None:
    """A second sidecar pointed at a tier another one holds does not start, and says
    which process holds it."""
    with run_sidecar_process(with_tier(tmp_path / "tier")) as first:
        with pytest.raises(RuntimeError, match=f"another sidecar \\(pid {first.pid}\\)"):
            with run_sidecar_process(with_tier(tmp_path / "tier")):
                pass


def replayed(endpoint: str) -> list[dict[str, Any]]:
    """Every event the sidecar's replay socket still holds, from sequence 0, in order."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[dict[str, Any]] = []
        while True:
            assert dealer.poll(TIMEOUT * 1000), "no replay answer"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return events
            batch = msgspec.msgpack.decode(payload)
            events.extend(batch[1])
    finally:
        context.destroy(linger=0)


def media(events: list[dict[str, Any]], block_hash: int) -> list[tuple[str, str]]:
    """(event type, medium) of every event about one block of store group 0, in order."""
    return [(event["type"], event["medium"]) for event in events
            if block_hash in event.get("block_hashes", ()) and event.get("group_idx") == 0]


async def test_explain_and_kv_events_follow_a_value_between_memory_and_disk(
        tmp_path: Path) -> None:
    """A value evicted from memory is still present, ``on disk``; KV events announce it
    stored in cpu, then on disk, removed from cpu, and stored in cpu again when a load
    promotes it. After a restart the first event clears everything and every value on
    disk is announced again, from sequence 0."""
    layout = hybrid_layout(page_bytes=4096)
    saver = KVEngine(layout)
    span = value_span(2 * 4096 + 8)
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    overrides = with_tier(tmp_path / "tier", capacity_bytes=2 * 8 * span + 1000)
    overrides["events"] = {"endpoint": f"ipc://{events_dir}/pub",
                           "replay_endpoint": f"ipc://{events_dir}/replay"}
    first_prompt, second, third = (prompt(index) for index in range(3))
    first_hash = external_hash(block_hashes(first_prompt, 16)[0], as_int=True)
    with anyio.fail_after(TIMEOUT * 2):
        with run_sidecar_process(overrides, metrics=True) as sidecar:
            async with await saver.connect(sidecar.endpoint) as client:
                stored = 0
                for index, tokens in enumerate((first_prompt, second, third)):
                    stored += (await client.save(f"s{index}", tokens, blocks_of(index))).stored
                    while written(sidecar) < stored:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                evicted = await client.lookup(first_prompt, explain=True)
                assert evicted.hit_tokens == 64
                assert {(b.verdict, b.reason) for b in evicted.blocks} == {("present", "on disk")}
                kept = await client.lookup(third, explain=True)
                assert {(b.verdict, b.reason) for b in kept.blocks} == {
                    ("present", "in memory and on disk")}
            hits = await load_and_check(sidecar, saver, range(1), layout)
            assert hits == {0: 64}
            events = replayed(f"ipc://{events_dir}/replay")
            assert events[0]["type"] == "AllBlocksCleared"
            assert media(events, first_hash) == [
                ("BlockStored", "cpu"), ("BlockStored", "disk"), ("BlockRemoved", "cpu"),
                ("BlockStored", "cpu")]
            assert sidecar.terminate() == 0
        with run_sidecar_process(overrides):
            await anyio.sleep(0.5)
            events = replayed(f"ipc://{events_dir}/replay")
    assert events[0]["type"] == "AllBlocksCleared"
    announced = [event for event in events[1:] if event["type"] == "BlockStored"]
    assert {event["medium"] for event in announced} == {"disk"}
    assert len(announced) == stored and media(events, first_hash) == [("BlockStored", "disk")]


def disk_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.app.cli", "disk", *args],
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)


async def test_an_operator_shows_and_clears_a_tier(tmp_path: Path) -> None:
    """``kvsidecar disk`` refuses while a sidecar holds the tier; once it is stopped,
    ``show`` counts the values per tenant and ``clear`` empties the tier, so the next
    sidecar starts cold."""
    saver = KVEngine(LAYOUT)
    tier = str(tmp_path / "tier")
    with anyio.fail_after(TIMEOUT * 2):
        with run_sidecar_process(with_tier(tmp_path / "tier")) as sidecar:
            async with await saver.connect(sidecar.endpoint) as client:
                stored = (await client.save("s", prompt(0), blocks_of(0))).stored
            held = await anyio.to_thread.run_sync(disk_command, "clear", "--path", tier)
            assert held.returncode == 1 and f"pid {sidecar.pid}" in held.stderr
            assert sidecar.terminate() == 0
        shown = await anyio.to_thread.run_sync(disk_command, "show", "--path", tier, "--json")
        assert shown.returncode == 0, shown.stderr
        summary = json.loads(shown.stdout)
        assert summary["values"] == stored and set(summary["value_bytes"]) == {"default"}
        cleared = await anyio.to_thread.run_sync(disk_command, "clear", "--path", tier)
        assert cleared.returncode == 0 and "starts cold" in cleared.stdout
        with run_sidecar_process(with_tier(tmp_path / "tier")) as cold:
            assert await load_and_check(cold, saver, range(1)) == {0: 0}
