"""The declared stage graph: when each stage waits for an item, under each config."""

from __future__ import annotations

import msgspec

from pipeline.app.graph import build_graph, paths
from pipeline.core.config import Config, MooncakeStoreConfig, StoreConfig
from pipeline.runner import ALWAYS, BATCHING_WAITS, NEVER


def waits(config: Config) -> dict[str, str]:
    """``path.stage`` → when the stage waits, as ``kvsidecar graph`` prints it."""
    return {f"{row.path}.{row.stage}": row.waits for row in build_graph(config).rows()}


def test_with_the_embedded_store_a_request_runs_in_the_receive_loop_up_to_its_copy() -> None:
    """Only the copies, long prompts' hashing and explanations wait; the store's calls
    are in this process, so dedup, commit and fetch run where the request is."""
    got = waits(Config())
    assert got["save.group_filter"] == got["load.group_filter"] == NEVER.text
    assert got["save.hashing"] == "for a long prompt (hashed in a thread)"
    assert got["save.dedup"] == got["save.commit"] == got["load.fetch"] == NEVER.text
    assert got["save.transfer"] == ALWAYS.text
    assert got["load.scatter"] == "for a large copy (copy threads)"
    assert got["lookup.lookup"] == "for a long prompt or an explanation"
    assert got["save.batching"] == BATCHING_WAITS


def test_with_a_store_in_another_process_every_store_call_waits() -> None:
    config = msgspec.structs.replace(Config(), store=StoreConfig(
        backend="mooncake", mooncake=MooncakeStoreConfig(in_place=False)))
    got = waits(config)
    assert got["save.dedup"] == got["save.commit"] == got["load.fetch"] == ALWAYS.text
    assert got["lookup.lookup"] == ALWAYS.text


def test_the_three_paths_are_declared_with_their_stages_in_order() -> None:
    assert [path.name for path in paths(Config())] == ["save", "load", "lookup"]
    assert [spec.name for spec in paths(Config())[0].stages] == [
        "group_filter", "hashing", "dedup", "batching", "transfer", "commit"]
