"""Prometheus metrics: what the sidecar did, block by block, and how long engines waited.

One registry per sidecar (so tests can run several in a process); served over HTTP on
loopback when ``metrics.port`` is set.
"""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pipeline.core.messages import LoadDone, SaveDone, SidecarMessage

__all__ = ["Metrics"]

# Fine enough around a millisecond that a p99 can be told from twice the p50.
_LATENCY_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003,
                    0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5)


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
        self.blocks = Counter(
            "kvsidecar_blocks", "Block outcomes reported to engines", ["path", "status", "reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvsidecar_request_seconds", "From receiving a request to sending its reply",
            ["kind"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.sessions = Gauge(
            "kvsidecar_sessions", "Registered engines", registry=self.registry
        )
        self.reaped = Counter(
            "kvsidecar_sessions_reaped", "Engines reaped after going silent or exiting",
            registry=self.registry,
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

    def replied(self, message: SidecarMessage, received_at: float) -> None:
        """Count a completion's blocks and how long its engine waited."""
        if isinstance(message, SaveDone | LoadDone):
            path = "save" if isinstance(message, SaveDone) else "load"
            # Reasons may carry details ("size_mismatch: ..."): label only their kind.
            counts = collections.Counter(
                (block.status, block.reason.split(":", 1)[0]) for block in message.blocks
            )
            for (status, reason), count in counts.items():
                self.blocks.labels(path, status, reason).inc(count)
        else:
            path = "lookup"
        self.latency.labels(path).observe(time.monotonic() - received_at)

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics over HTTP (a daemon thread of prometheus_client)."""
        start_http_server(port, addr=host, registry=self.registry)
