"""Prometheus metrics: what the sidecar did, block by block, and how long engines waited.

One registry per sidecar (so tests can run several in a process); served over HTTP on
``metrics.listen`` when it is set. What is only worth knowing at scrape time (queue
depths, store fill, the breaker, the engines' layouts) is read then, by collectors.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import gc
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pipeline.app.backends import Usage
from pipeline.backends.stores.disk.tier import DiskTier
from pipeline.core.messages import LoadDone, Lookup, LookupReply, SaveDone, prompt_length
from pipeline.core.outcomes import BlockStatus
from pipeline.state.jobs import Reply
from pipeline.state.sessions import EngineSession

__all__ = ["BackendGauges", "Metrics", "Outcomes"]

Outcomes = collections.Counter[tuple[BlockStatus, str]]
"""A reply's blocks by status and reason kind (``pipeline.core.messages.outcome_counts``)."""

# Fine enough around a millisecond that a p99 can be told from twice the p50: 50 µs
# apart from 0.1 to 0.5 ms, where an idle sidecar answers a load, and 100 µs apart up to
# 1 ms. A quantile is interpolated inside its bucket: in one from 0.5 to 0.75 ms, a
# p50 of 0.5 ms could be read as anything up to 0.75 ms.
_LATENCY_BUCKETS = (0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.00035, 0.0004, 0.00045,
                    0.0005, 0.0006, 0.0007, 0.0008, 0.0009, 0.001, 0.00125, 0.0015, 0.00175,
                    0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                    0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5)
# An item usually waits microseconds in an edge; a backed-up one, up to seconds.
_WAIT_BUCKETS = (0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3)


@dataclasses.dataclass(frozen=True)
class BackendGauges:
    """What the backends report when scraped."""

    store_used: Usage | None
    """None where the store does not say (Mooncake)."""
    breaker_state: Callable[[], str]
    staging: Callable[[], tuple[int, int, int, int]]
    """(save slots in use, save slots, load slots in use, load slots)."""
    reads_here: Callable[[], tuple[int, int]] | None = None
    """Values loads read where they lie: (loaded, failed as read past their lease); None
    where loads never do."""
    disk: DiskTier | None = None
    """The disk tier, if there is one."""


class _Collector(Collector):
    """Metrics computed when scraped (in the HTTP server's thread: reads only)."""

    def __init__(self, backends: BackendGauges,
                 sessions: Callable[[], Iterable[EngineSession]]) -> None:
        self._backends = backends
        self._sessions = sessions

    def collect(self) -> Iterator[Metric]:
        backends = self._backends
        if backends.store_used is not None:
            used, capacity, evictions = backends.store_used()
            yield GaugeMetricFamily("kvsidecar_store_used_bytes", "Bytes the store holds",
                                    value=used)
            yield GaugeMetricFamily("kvsidecar_store_capacity_bytes",
                                    "Bytes the store may hold", value=capacity)
            yield CounterMetricFamily("kvsidecar_store_evictions",
                                      "Values evicted to make room", value=evictions)
        if backends.reads_here is not None:
            read = CounterMetricFamily(
                "kvsidecar_store_values_read_here",
                "Values loads copied from where they lie in the sidecar's own segment, by "
                "outcome (the others move through the store's get)", labels=["outcome"])
            for outcome, count in zip(("loaded", "lease_expired"), backends.reads_here(),
                                      strict=True):
                read.add_metric([outcome], count)
            yield read
        if backends.disk is not None:
            yield from _disk_metrics(backends.disk)
        breaker = GaugeMetricFamily(
            "kvsidecar_store_breaker", "The store's circuit breaker (1: its state now)",
            labels=["state"])
        state = backends.breaker_state()
        for name in ("closed", "half_open", "open"):
            breaker.add_metric([name], float(name == state))
        yield breaker
        staging = GaugeMetricFamily(
            "kvsidecar_staging_slots", "Staging slots, by lane and use", labels=["lane", "use"])
        save_used, save_slots, load_used, load_slots = backends.staging()
        for lane, used, slots in (("save", save_used, save_slots), ("load", load_used, load_slots)):
            staging.add_metric([lane, "used"], used)
            staging.add_metric([lane, "total"], slots)
        yield staging
        groups = GaugeMetricFamily(
            "kvsidecar_engine_group",
            "Registered engines' kv-cache groups (1: stored, 0: ignored)",
            labels=["engine_id", "kv_group", "kind", "block_size", "store_group"])
        for session in list(self._sessions()):
            layout = session.layout
            for kv_group, group in enumerate(layout.groups):
                store_group = layout.store_group_index(kv_group)
                groups.add_metric(
                    [session.engine_id, str(kv_group), str(group.kind), str(group.block_size),
                     "" if store_group is None else str(store_group)],
                    float(store_group is not None))
        yield groups


def _disk_metrics(disk: DiskTier) -> Iterator[Metric]:
    """The disk tier's fill and traffic (read from the scraping thread: copies only)."""
    counters = disk.counters
    yield GaugeMetricFamily("kvsidecar_disk_enabled",
                            "1 while the disk tier serves; 0 once a disk error turned it off",
                            value=float(disk.enabled))
    yield GaugeMetricFamily("kvsidecar_disk_used_bytes",
                            "Bytes the disk tier's segment files take", value=disk.used_bytes)
    yield GaugeMetricFamily("kvsidecar_disk_capacity_bytes",
                            "Bytes the disk tier may take (store.disk.bytes)",
                            value=disk.space.budget)
    yield GaugeMetricFamily("kvsidecar_disk_values", "Values durable on disk",
                            value=len(disk.sizes))
    by_tenant = GaugeMetricFamily("kvsidecar_disk_value_bytes",
                                  "Bytes on disk of the records that stand, by tenant",
                                  labels=["tenant"])
    for tenant, held in dict(disk.index.tenant_bytes).items():
        by_tenant.add_metric([tenant], held)
    yield by_tenant
    yield GaugeMetricFamily("kvsidecar_disk_queued_bytes",
                            "Bytes of values waiting to be written to disk",
                            value=disk.queued_bytes)
    for name, help_text, count in (
            ("writes", "Values written to disk (durable)", counters.writes),
            ("written_bytes", "Bytes of records written to disk", counters.written_bytes),
            ("reads", "Values read back from disk, checked", counters.reads),
            ("read_bytes", "Bytes of records read back from disk", counters.read_bytes),
            ("skipped", "Values never written: evicted from memory while the disk was "
             "behind, or too large for a batch", counters.skipped),
            ("errors", "Disk errors (the first turns the tier off)", counters.errors),
            ("evicted", "Values on disk dropped with their segment to keep the budget",
             counters.evicted)):
        yield CounterMetricFamily(f"kvsidecar_disk_{name}", help_text, value=count)
    dropped = CounterMetricFamily("kvsidecar_disk_dropped",
                                  "Records found bad and never loaded, by reason",
                                  labels=["reason"])
    for reason, count in dict(counters.dropped).items():
        dropped.add_metric([reason], count)
    yield dropped


class _Waits:
    """How long items waited in one edge: a histogram observed without a lock.

    An item may pass several edges a request, each observed, and prometheus_client's
    histogram takes a lock for each of the
    two or three values it adds to: in a profile of tiny requests, about a tenth of the
    event loop's time per request went to that. Only the event loop observes; a scrape
    reads the plain ints and float in the server's thread, each whole under the GIL."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(_WAIT_BUCKETS) + 1)  # per bucket, then past the last
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_WAIT_BUCKETS, seconds)] += 1
        self.sum += seconds


_label_of = cast(Callable[[float], str], floatToGoString)
"""A bucket's ``le`` label, as prometheus_client spells it (it declares no types)."""


class _WaitsCollector(Collector):
    """``kvsidecar_edge_wait_seconds``, read from each edge's ``_Waits`` when scraped."""

    def __init__(self) -> None:
        self.edges: dict[tuple[str, str], _Waits] = {}

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "kvsidecar_edge_wait_seconds", "How long items waited in a stage's inbox",
            labels=["path", "stage"])
        bounds = [_label_of(bound) for bound in (*_WAIT_BUCKETS, float("inf"))]
        for labels, waits in list(self.edges.items()):
            total = waits.sum
            family.add_metric(labels, list(zip(bounds, itertools.accumulate(waits.counts),
                                               strict=True)), total)
        yield family


def _child(children: dict[tuple[object, ...], Counter], counter: Counter,
           *labels: object) -> Counter:
    """``counter.labels(*labels)``, resolved once into ``children``."""
    child = children.get(labels)
    if child is None:
        child = children[labels] = counter.labels(*labels)
    return child


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvsidecar_requests", "Engine requests received, by kind", ["kind"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvsidecar_rejected", "Frames and requests refused with an error reply, by code",
            ["code"], registry=self.registry,
        )
        self.internal = Counter(
            "kvsidecar_internal_errors",
            "Messages whose handling failed inside the sidecar (a bug: answered as internal)",
            registry=self.registry,
        )
        self.over_limit = Counter(
            "kvsidecar_over_limit", "Requests and registrations refused past a limit, by limit",
            ["limit"], registry=self.registry,
        )
        self.blocks = Counter(
            "kvsidecar_blocks", "Block outcomes reported to engines", ["path", "status", "reason"],
            registry=self.registry,
        )
        self.lookup_tokens = Counter(
            "kvsidecar_lookup_tokens", "Tokens looked up, and of those, hit", ["kind"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvsidecar_request_seconds",
            "From receiving a request to handing its reply to the socket",
            ["kind"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.moved = Counter(
            "kvsidecar_bytes",
            "Value bytes moved, counted as each copy (engine <-> values) or store call "
            "(put, get) completes", ["path", "via"], registry=self.registry,
        )
        self.queued = Gauge(
            "kvsidecar_edge_queued", "Items waiting in a stage's inbox", ["path", "stage"],
            registry=self.registry,
        )
        self.edge_capacity = Gauge(
            "kvsidecar_edge_capacity", "The bound of a stage's inbox", ["path", "stage"],
            registry=self.registry,
        )
        self._waited = _WaitsCollector()
        self.registry.register(self._waited)
        self.sessions = Gauge(
            "kvsidecar_sessions", "Registered engines", registry=self.registry
        )
        self.reaped = Counter(
            "kvsidecar_sessions_reaped", "Engines reaped after going silent or exiting",
            registry=self.registry,
        )
        self.cancels = Counter(
            "kvsidecar_cancels", "Cancels received from engines, by whether their request "
            "was still open", ["request"], registry=self.registry,
        )
        self.late = Counter(
            "kvsidecar_late_completions",
            "Saves and loads answered past their deadline (the engine had given up waiting)",
            registry=self.registry,
        )
        self.deadlines_missed = Gauge(
            "kvsidecar_deadlines_missed",
            "Saves and loads stopped because their deadline passed before a copy of them "
            "started (a count since start)", registry=self.registry,
        )
        self.copies_in_flight = Gauge(
            "kvsidecar_copies_in_flight",
            "Copies of engine memory (and store calls) of saves and loads in flight: a "
            "cancel of their request waits for them", registry=self.registry,
        )
        self.open_jobs = Gauge(
            "kvsidecar_open_jobs", "Saves and loads accepted and not yet answered",
            registry=self.registry,
        )
        self.withheld_slots = Gauge(
            "kvsidecar_staging_withheld_slots",
            "Staging slots kept out of use while an abandoned store call may still touch them",
            registry=self.registry,
        )
        self.events_dropped = Gauge(
            "kvsidecar_kv_events_dropped",
            "KV events dropped because more than events.max_pending were waiting",
            registry=self.registry,
        )
        self.gc_pauses = Histogram(
            "kvsidecar_gc_pause_seconds",
            "Garbage collections of the sidecar's process, by generation: each holds up the "
            "event loop, and every request in flight with it",
            ["generation"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        # Children resolved once: ``labels()`` on every reply costs more than the count.
        self._latency = {kind: self.latency.labels(kind) for kind in ("save", "load", "lookup")}
        self._requests: dict[tuple[object, ...], Counter] = {}
        self._blocks: dict[tuple[object, ...], Counter] = {}
        self._queried = self.lookup_tokens.labels("queried")
        self._hit = self.lookup_tokens.labels("hit")

    def watch(self, backends: BackendGauges,
              sessions: Callable[[], Iterable[EngineSession]]) -> None:
        """Read the backends and the registered engines at every scrape."""
        self.registry.register(_Collector(backends, sessions))

    def watch_edge(self, path: str, stage: str, size: int, queued: Callable[[], int]
                   ) -> Callable[[float], None]:
        """Report an edge's depth at every scrape; returns what observes its waits."""
        self.queued.labels(path, stage).set_function(queued)
        self.edge_capacity.labels(path, stage).set(size)
        waits = self._waited.edges[path, stage] = _Waits()
        return waits.observe

    @contextlib.contextmanager
    def timing_collections(self) -> Iterator[None]:
        """Time every garbage collection while inside (of the whole process: a sidecar
        run in a test's process also times the test's)."""
        observe = [self.gc_pauses.labels(str(generation)).observe for generation in range(3)]
        started = 0.0

        def timed(phase: str, info: dict[str, int]) -> None:
            nonlocal started
            if phase == "start":
                started = time.perf_counter()
            else:
                observe[info["generation"]](time.perf_counter() - started)

        gc.callbacks.append(timed)
        try:
            yield
        finally:
            gc.callbacks.remove(timed)

    def mover(self, path: str, via: str) -> Callable[[int], None]:
        """What counts bytes moved on ``path`` (save, load) ``via`` (copy, store)."""
        return self.moved.labels(path, via).inc

    def received(self, kind: str) -> None:
        """Count a request received (``kind``: its message tag)."""
        _child(self._requests, self.requests, kind).inc()

    def replied(self, reply: Reply, outcomes: Outcomes, sent_at: float) -> None:
        """Count a completion's block ``outcomes`` (``outcome_counts`` of its blocks), a
        lookup's tokens, and how long the engine waited: until ``sent_at``
        (``time.monotonic``), when the reply was handed to the socket."""
        message = reply.message
        if isinstance(message, SaveDone | LoadDone):
            path = "save" if isinstance(message, SaveDone) else "load"
            for (status, reason), count in outcomes.items():
                _child(self._blocks, self.blocks, path, status, reason).inc(count)
        else:
            path = "lookup"
            asked = reply.request.message
            if isinstance(message, LookupReply) and isinstance(asked, Lookup) and not (
                    asked.explain):  # an operator's question is not a cache use
                self._queried.inc(prompt_length(asked))
                self._hit.inc(message.hit_tokens)
        self._latency[path].observe(sent_at - reply.received_at)

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics over HTTP (a daemon thread of prometheus_client)."""
        start_http_server(port, addr=host, registry=self.registry)
