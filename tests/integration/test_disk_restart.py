"""A sidecar with a disk tier restarts warm: engines hit again on what it saved before a
SIGTERM, and after a SIGKILL on every value that was durable, byte for byte."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

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


async def load_and_check(sidecar: SidecarProcess, saver: KVEngine,
                         indices: range) -> dict[int, int]:
    """Load each prompt into a fresh engine; the tokens each hit, after checking that
    every block loaded equals the block it was saved from."""
    reader = KVEngine(LAYOUT)
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
    over them. Of the saves the kill cut off, whatever hits is equally exact."""
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
    assert set(cut_off.values()) <= {0, 16, 32, 48, 64}


async def test_one_tier_belongs_to_one_sidecar(tmp_path: Path) -> None:
    """A second sidecar pointed at a tier another one holds does not start, and says
    which process holds it."""
    with run_sidecar_process(with_tier(tmp_path / "tier")) as first:
        with pytest.raises(RuntimeError, match=f"another sidecar \\(pid {first.pid}\\)"):
            with run_sidecar_process(with_tier(tmp_path / "tier")):
                pass
