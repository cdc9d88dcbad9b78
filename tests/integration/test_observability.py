"""What a running sidecar tells its operator: metrics scraped during real saves and
loads against what the engines saw, and one log line per request."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from prometheus_client.samples import Sample

from pipeline.backends import _blockcopy
from pipeline.core.config import Config
from pipeline.core.errors import RequestRejected
from pipeline.core.hashing import block_hashes
from pipeline.core.runs import value_span
from pipeline.testing import run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens
from transport.client import EngineClient, Explanation

TIMEOUT = 60
PAGE_BYTES = 4096
STORED_BYTES = 2 * PAGE_BYTES + 8
"""One stored block of the hybrid test layout: two layers' pages and the checksum."""
KVSIDECAR = [sys.executable, "-m", "pipeline.app.cli"]


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
        log = sidecar.final_log()

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
    # the arena holds each value padded to a cache line
    assert value(after, "kvsidecar_store_used_bytes") == stored * value_span(STORED_BYTES)
    assert value(after, "kvsidecar_store_evictions_total") == 0
    assert value(after, "kvsidecar_store_breaker", state="closed") == 1

    # Each save waited for the copy threads once per batch; the receive loop ran the
    # stages that do not wait, so nothing else entered an inbox; nothing waits any more.
    waits = values(after, "kvsidecar_edge_wait_seconds_count")
    assert waits[("save", "transfer")] >= 3
    assert waits[("save", "group_filter")] == waits[("load", "group_filter")] == 0
    assert waits[("lookup", "lookup")] == 0
    assert set(values(after, "kvsidecar_edge_queued").values()) == {0}
    stages = Config().stages
    capacity = values(after, "kvsidecar_edge_capacity")
    assert capacity[("save", "transfer")] == stages.transfer.inbox_size
    assert capacity[("lookup", "lookup")] == stages.lookup.inbox_size

    # The start-up line says how this CPU's copies run.
    [ready] = [json.loads(line) for line in log.splitlines()
               if line.startswith("{") and '"sidecar.ready"' in line]
    assert ready["copies"] == {"streaming_store_bytes": _blockcopy.stream_width(),
                               "seal_in_copy_pass": _blockcopy.fused_seal()}

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
            # run by the receiver and answered from inside the scatter stage, every stage
            # still marked, in order
            assert list(line["stages"]) == [
                "group_filter", "hashing", "fetch", "scatter", "completion"]
            assert sorted(line["stages"].values()) == list(line["stages"].values())
        else:
            assert line["hit_tokens"] == 64 and line["tokens"] == 69


def verdicts(explanation: Explanation) -> set[tuple[int, str]]:
    """(kv-cache group id, verdict) of every block explained."""
    return {(block.group_id, block.verdict) for block in explanation.blocks}


async def test_explain_says_why_each_block_of_a_prompt_misses(tmp_path: Path) -> None:
    """Against a live sidecar whose store holds two prompts: a prompt saved and still
    there is present; one pushed out by later saves is evicted; tokens saved under a
    cache salt are found under other keys; blocks another tenant (cache prefix) saved are
    in another namespace; unseen tokens were never stored. The client's
    ``lookup(explain=True)``, the unregistered ``explain_for`` and ``kvsidecar explain``
    all say so, and the ring is never explained."""
    layout = hybrid_layout(page_bytes=PAGE_BYTES)
    a, tenant = KVEngine(layout), KVEngine({**layout, "cache_prefix": "tenant-b"})
    blocks = [[1, 2, 3, 4], [7], [1, 2, 3, 4]]
    first, salted, last, other, unseen = (random_tokens(64, seed=300 + i) for i in range(5))
    # Room for two prompts (8 values each): the third save evicts the first.
    overrides = {"store": {"embedded": {"capacity_bytes": 2 * 8 * STORED_BYTES + 1000}}}
    with run_sidecar_process(overrides) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await a.connect(sidecar.endpoint, engine_id="a") as client, \
                    await tenant.connect(sidecar.endpoint, engine_id="b") as b:
                assert (await client.save("1", first, blocks)).stored == 8
                assert (await client.save("2", salted, blocks, cache_salt="s")).stored == 8
                assert (await client.save("3", last, blocks)).stored == 8
                assert (await b.save("4", other, blocks)).stored == 8

                explained = await client.lookup(last, explain=True)
                assert explained.hit_tokens == 48
                assert verdicts(explained) == {(0, "present"), (2, "present")}
                assert [b.block_index for b in explained.blocks if b.group_id == 0] == [0, 1, 2, 3]

                evicted = await client.lookup(first, explain=True)
                assert evicted.hit_tokens == 0
                assert verdicts(evicted) == {(0, "evicted"), (2, "evicted")}
                assert all(b.reason == "evicted to make room" and b.age_s >= 0
                           for b in evicted.blocks)

                unsalted = await EngineClient.explain_for(sidecar.endpoint, engine_id="a",
                                                          token_ids=salted)
                assert verdicts(unsalted) == {(0, "other_keys"), (2, "other_keys")}
                assert "cache salt" in unsalted.blocks[0].reason

                tenants = await EngineClient.explain_for(
                    sidecar.endpoint, engine_id="a", block_hashes=block_hashes(other, 16))
                assert verdicts(tenants) == {(0, "other_namespace"), (2, "other_namespace")}
                assert "tenant-b" in tenants.blocks[0].reason

                never = await client.lookup(unseen, explain=True)
                assert verdicts(never) == {(0, "never_stored"), (2, "never_stored")}

                with pytest.raises(RequestRejected, match=r"^bad_request: not exactly one engine"):
                    await EngineClient.explain_for(sidecar.endpoint, token_ids=first)

                prompt = tmp_path / "prompt.json"
                prompt.write_text(json.dumps(first))
                command = [*KVSIDECAR, "explain", "--endpoint", sidecar.endpoint,
                           "--engine", "a", "--tokens-file", str(prompt)]
                as_json, table = await anyio.to_thread.run_sync(lambda: [
                    subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT)
                    for args in ([*command, "--json"], command)])
        sidecar_log = sidecar.final_log()
    assert as_json.returncode == 0, as_json.stderr
    printed = json.loads(as_json.stdout)
    assert printed["hit_tokens"] == 0
    assert {(b["group_id"], b["verdict"]) for b in printed["blocks"]} == verdicts(evicted)
    assert printed["blocks"][0]["block_hash"] == evicted.blocks[0].block_hash.hex()
    assert table.returncode == 0, table.stderr
    assert "0-3" in table.stdout and "evicted to make room" in table.stdout
    lines = [json.loads(line) for line in sidecar_log.splitlines() if '"request.done"' in line]
    # Every explanation (5 here, 2 from the command) is a lookup, logged as one.
    assert [line["explained_blocks"] for line in lines if line["kind"] == "lookup"] == [8] * 7


async def test_a_save_refused_as_overloaded_is_explained_and_summed_up_in_the_log() -> None:
    """With one save per engine allowed in flight and a slow transfer, a second save is
    refused at once as overloaded; explaining its prompt says so, and the log has one
    saves.refused line for the engine instead of a request.done line for it."""
    layout = hybrid_layout(page_bytes=PAGE_BYTES)
    engine = KVEngine(layout)
    blocks = [[1, 2, 3, 4], [7], [1, 2, 3, 4]]
    slow, refused = random_tokens(64, seed=400), random_tokens(64, seed=401)
    overrides = {"stages": {"receive": {"max_saves_per_engine": 1}},
                 "faults": {"points": {"stage.transfer": {"delay_ms": 500}}}}
    with run_sidecar_process(overrides) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await engine.connect(sidecar.endpoint, engine_id="busy") as client:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.save, "slow", slow, blocks)
                    await anyio.sleep(0.2)  # the slow save is in flight
                    answer = await client.save("refused", refused, [[5, 6, 8, 9], [7],
                                                                     [5, 6, 8, 9]])
                assert answer.skipped == 8 and {b.reason for b in answer.blocks} == {
                    "overloaded"}
                explained = await client.lookup(refused, explain=True)
                assert verdicts(explained) == {(0, "skipped"), (2, "skipped")}
                assert explained.blocks[0].reason == "overloaded (the save was refused)"
                assert verdicts(await client.lookup(slow, explain=True)) == {
                    (0, "present"), (2, "present")}
        log = sidecar.final_log()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert [(line["engine_id"], line["saves"]) for line in lines
            if line["event"] == "saves.refused"] == [("busy", 1)]
    saves = [line["request_id"] for line in lines
             if line["event"] == "request.done" and line["kind"] == "save"]
    assert saves == ["slow"]
