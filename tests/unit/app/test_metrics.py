"""The sidecar's own metrics that no request produces."""

from __future__ import annotations

import gc

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pipeline.app.metrics import _WAIT_BUCKETS, Metrics


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


def exposed(registry: CollectorRegistry, name: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if name in line and "_created" not in line]


@given(st.lists(st.one_of(st.just(0.0), st.sampled_from(_WAIT_BUCKETS),
                          st.floats(0.0, 10.0)), max_size=40))
def test_edge_waits_are_exposed_as_prometheus_clients_own_histogram_would(
        waits: list[float]) -> None:
    """The edges' lock-free wait histograms read, when scraped, exactly as a
    prometheus_client Histogram with the same buckets and the same observations:
    bucket edges included, inline runs' zero waits in the first bucket."""
    metrics = Metrics()
    observe = metrics.watch_edge("save", "hashing", 64, lambda: 0)
    metrics.watch_edge("load", "fetch", 8, lambda: 0)  # observed nothing: all zeros
    reference = CollectorRegistry()
    histogram = Histogram("kvsidecar_edge_wait_seconds",
                          "How long items waited in a stage's inbox", ["path", "stage"],
                          buckets=_WAIT_BUCKETS, registry=reference)
    for labels in (("save", "hashing"), ("load", "fetch")):  # in the order watched
        histogram.labels(*labels)
    for seconds in waits:
        observe(seconds)
        histogram.labels("save", "hashing").observe(seconds)
    name = "kvsidecar_edge_wait_seconds"
    assert exposed(metrics.registry, name) == exposed(reference, name)
