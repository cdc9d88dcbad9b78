"""The sidecar's own metrics that no request produces."""

from __future__ import annotations

import gc

from pipeline.app.metrics import Metrics


def collections_timed(metrics: Metrics, generation: int) -> float:
    value = metrics.registry.get_sample_value(
        "kvsidecar_gc_pause_seconds_count", {"generation": str(generation)})
    return value or 0.0


def test_every_collection_is_timed_by_generation_while_watched_and_none_after() -> None:
    metrics = Metrics()
    with metrics.timing_collections():
        gc.collect(2)
        assert collections_timed(metrics, 2) >= 1
        gc.collect(1)
        assert collections_timed(metrics, 1) >= 1  # and any the test's own allocations began
    timed = [collections_timed(metrics, generation) for generation in range(3)]
    gc.collect(2)
    gc.collect(1)
    assert [collections_timed(metrics, generation) for generation in range(3)] == timed
    assert metrics.registry.get_sample_value(
        "kvsidecar_gc_pause_seconds_sum", {"generation": "2"}) > 0
