"""Fault injection: a fault point in every stage and in the store, several engines.

Whatever fails, every request gets its completion, and no loaded byte is ever wrong:
a block is either verified byte-exact against what its producer wrote, or reported
failed so the engine recomputes it.
"""

from __future__ import annotations

import anyio
import psutil

from pipeline.app.engine_sim import SimReport, load_layout, run_workload
from pipeline.testing import run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens

STAGE_POINTS = ("group_filter", "hashing", "dedup", "transfer", "commit", "fetch", "scatter")


def fault_config(error_rate: float, corrupt_rate: float) -> dict[str, object]:
    points: dict[str, dict[str, float]] = {
        f"stage.{name}": {"error_rate": error_rate} for name in STAGE_POINTS
    }
    points["store.exists"] = {"error_rate": error_rate}
    points["store.put"] = {"error_rate": error_rate, "delay_ms": 1.0,
                           "corrupt_rate": corrupt_rate}
    points["store.get"] = {"error_rate": error_rate}
    # A high threshold keeps the breaker closed so that every point keeps firing.
    return {
        "faults": {"seed": 7, "points": points},
        "store": {"breaker": {"failure_threshold": 1000}},
        "staging": {"pool_bytes": 32 * 1024 * 1024, "slot_bytes": 4 * 1024 * 1024,
                    "load_slots": 2},
    }


async def test_every_request_is_answered_and_no_corrupt_byte_is_loaded() -> None:
    """Three engines against a sidecar whose stages and store fail 5% of calls and
    corrupt 30% of loaded values: requests sent == completions received, every loaded
    block verifies, corrupted blocks come back failed, memory stays bounded."""
    layout = load_layout("qwen3-next-hybrid", block_size=16)
    requests_per_engine = 40
    reports: list[SimReport] = []
    with run_sidecar_process(fault_config(error_rate=0.05, corrupt_rate=0.3)) as sidecar:
        process = psutil.Process(sidecar.pid)
        peak_rss = process.memory_info().rss

        async def engine(index: int) -> None:
            reports.append(await run_workload(
                sidecar.endpoint, layout, engine_id=f"faulty-{index}",
                requests=requests_per_engine, prefixes=3, seed=index, concurrency=4,
            ))

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                for index in range(3):
                    tg.start_soon(engine, index)
                while len(reports) < 3:
                    peak_rss = max(peak_rss, process.memory_info().rss)
                    await anyio.sleep(0.05)
        log = sidecar.log()
        assert sidecar.terminate() == 0, log
    total = SimReport()
    for report in reports:
        total.merge(report)
    print(
        f"\nfault suite: requests sent {3 * requests_per_engine}, "
        f"completed {total.requests - total.errors}; "
        f"blocks loaded+verified {total.blocks_verified}, mismatched {total.blocks_mismatched}, "
        f"failed {total.blocks_failed}, skipped {total.blocks_skipped}; "
        f"sidecar peak RSS {peak_rss / 2**20:.0f} MiB"
    )
    assert total.requests == 3 * requests_per_engine
    assert total.errors == 0  # every save, load and lookup was answered, none timed out
    assert total.blocks_mismatched == 0  # no silently wrong KV
    assert total.blocks_verified == total.blocks_loaded and total.blocks_loaded > 0
    assert "checksum_mismatch" in log or total.loaded_tokens < total.hit_tokens
    assert "stage.item.failed" in log
    assert peak_rss < 1536 * 2**20


async def test_corrupted_stored_bytes_reach_no_engine() -> None:
    """Every stored value corrupted at rest: the engine gets each block back as failed
    with checksum_mismatch, its own memory is left untouched, and the corrupted values
    are dropped so that the next save stores them afresh."""
    config: dict[str, object] = {"faults": {"points": {"store.put": {"corrupt_rate": 1.0}}}}
    layout = hybrid_layout()
    writer, reader = KVEngine(layout), KVEngine(layout)
    tokens = random_tokens(2 * 16 + 1, seed=31)
    with run_sidecar_process(config) as sidecar:
        with anyio.fail_after(30):
            async with await writer.connect(sidecar.endpoint) as a, \
                    await reader.connect(sidecar.endpoint) as b:
                assert (await a.save("w", tokens, [[1, 2, 3], [4], [1, 2, 3]])).stored == 4
                before = [reader.pages(0, 7), reader.pages(0, 8), reader.pages(2, 8)]
                loaded = await b.load("r", tokens, [[7, 8, 9], [5], [7, 8, 9]], 32)
                dropped = await b.lookup(tokens)
    assert loaded.loaded_tokens == 0
    assert sorted(loaded.invalid_block_ids) == [7, 8, 8]
    assert {r.reason for r in loaded.blocks} == {"checksum_mismatch"}
    assert dropped == 0
    after = [reader.pages(0, 7), reader.pages(0, 8), reader.pages(2, 8)]
    for pages_before, pages_after in zip(before, after, strict=True):
        assert all((x == y).all() for x, y in zip(pages_before, pages_after, strict=True))
