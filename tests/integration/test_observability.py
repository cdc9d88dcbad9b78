"""What a running sidecar tells its operator: metrics scraped during real saves and
loads against what the engines saw, and one log line per request."""

from __future__ import annotations

import collections
import json

import anyio
import anyio.to_thread
from prometheus_client.samples import Sample

from pipeline.core.config import Config
from pipeline.testing import run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens

TIMEOUT = 60
PAGE_BYTES = 4096
STORED_BYTES = 2 * PAGE_BYTES + 8
"""One stored block of the hybrid test layout: two layers' pages and the checksum."""


def values(samples: list[Sample], name: str, **labels: str) -> dict[tuple[str, ...], float]:
    """The samples named ``name`` whose labels include ``labels``, by their other labels."""
    found = {}
    for sample in samples:
        if sample.name == name and labels.items() <= sample.labels.items():
            rest = tuple(v for k, v in sorted(sample.labels.items()) if k not in labels)
            found[rest] = sample.value
    return found


def value(samples: list[Sample], name: str, **labels: str) -> float:
    (only,) = values(samples, name, **labels).values()
    return only


async def test_metrics_during_saves_and_loads_match_what_the_engines_saw() -> None:
    """Scraped while two engines save, look up and load: block outcomes, bytes moved
    (copies and store calls), lookup tokens and hits, per-edge waits and depths, store
    fill and the engines' stored and ignored groups all agree with the engines' replies."""
    layout = hybrid_layout(page_bytes=PAGE_BYTES)
    saver, loader = KVEngine(layout), KVEngine(layout)
    prompts = [random_tokens(4 * 16 + 5, seed=200 + i) for i in range(3)]
    blocks = [[1, 2, 3, 4, 5], [7], [1, 2, 3, 4, 5]]
    stored = loaded = queried = hits = 0
    with run_sidecar_process(metrics=True) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await saver.connect(sidecar.endpoint, engine_id="saver") as a, \
                    await loader.connect(sidecar.endpoint, engine_id="loader") as b:
                for i, tokens in enumerate(prompts):
                    stored += (await a.save(f"s{i}", tokens, blocks)).stored
                    queried += len(tokens)
                    hit = await b.lookup(tokens)
                    hits += hit
                    result = await b.load(f"l{i}", tokens, blocks, hit)
                    loaded += sum(r.status == "loaded" for r in result.blocks)
                during = await anyio.to_thread.run_sync(sidecar.metrics)
        after = await anyio.to_thread.run_sync(sidecar.metrics)
        log = sidecar.log()

    # A load of 64 tokens needs 4 full-attention blocks and the one mamba state at 64.
    assert (stored, loaded, hits) == (3 * 8, 3 * 5, 3 * 64)
    # The engines' layouts: the ring (kv-cache group 1) is ignored, the others stored.
    groups = values(during, "kvsidecar_engine_group")
    for engine in ("saver", "loader"):
        # (block_size, engine_id, kind, kv_group, store_group): labels in name order
        assert groups[("16", engine, "full_attention", "0", "0")] == 1
        assert groups[("4", engine, "circular_buffer", "1", "")] == 0
        assert groups[("16", engine, "mamba", "2", "1")] == 1
    assert value(during, "kvsidecar_sessions") == 2

    assert value(after, "kvsidecar_blocks_total", path="save", status="stored") == stored
    assert value(after, "kvsidecar_blocks_total", path="load", status="loaded") == loaded
    moved = values(after, "kvsidecar_bytes_total")
    assert moved == {("save", "copy"): stored * STORED_BYTES,
                     ("save", "store"): stored * STORED_BYTES,
                     ("load", "store"): loaded * STORED_BYTES,
                     ("load", "copy"): loaded * STORED_BYTES}
    assert value(after, "kvsidecar_lookup_tokens_total", kind="queried") == queried
    assert value(after, "kvsidecar_lookup_tokens_total", kind="hit") == hits
    assert value(after, "kvsidecar_store_used_bytes") == stored * STORED_BYTES
    assert value(after, "kvsidecar_store_evictions_total") == 0
    assert value(after, "kvsidecar_store_breaker", state="closed") == 1

    # Every request passed its path's first edge once; nothing waits any more.
    waits = values(after, "kvsidecar_edge_wait_seconds_count")
    assert waits[("save", "group_filter")] == waits[("load", "group_filter")] == 3
    assert waits[("lookup", "lookup")] == 3
    assert waits[("save.completion", "completion")] == 3
    assert set(values(after, "kvsidecar_edge_queued").values()) == {0}
    stages = Config().stages
    capacity = values(after, "kvsidecar_edge_capacity")
    assert capacity[("save", "transfer")] == stages.transfer.inbox_size
    assert capacity[("lookup", "lookup")] == stages.lookup.inbox_size

    # One request.done line per request, bound to its engine, with its stage timings.
    lines = [json.loads(line) for line in log.splitlines()
             if line.startswith("{") and '"request.done"' in line]
    kinds = collections.Counter((line["kind"], line["engine_id"]) for line in lines)
    assert kinds == {("save", "saver"): 3, ("lookup", "loader"): 3, ("load", "loader"): 3}
    for line in lines:
        if line["kind"] == "save":
            assert line["blocks"] == {"stored": 8, "skipped:incomplete_block": 2}
            assert list(line["stages"]) == [
                "group_filter", "hashing", "dedup", "transfer", "commit", "completion"]
            assert line["stages"]["commit"] <= line["ms"]
        elif line["kind"] == "load":
            assert line["blocks"] == {"loaded": 5} and line["loaded_tokens"] == 64
        else:
            assert line["hit_tokens"] == 64 and line["tokens"] == 69
