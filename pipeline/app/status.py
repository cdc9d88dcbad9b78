"""``kvsidecar status``: a running sidecar's metrics, read from its Prometheus endpoint."""

from __future__ import annotations

import collections
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rich.console import Console
from rich.table import Table

from pipeline.core.errors import TransportError

__all__ = ["read_metrics", "show_status"]


def _scrape(url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: bytes = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise TransportError(
            f"cannot read {url}: {exc}; is the sidecar running with metrics.port set?"
        ) from exc
    return body.decode()


def read_metrics(url: str, *, timeout_s: float = 5.0) -> list[Sample]:
    """Every sample a sidecar's Prometheus endpoint serves now."""
    return [
        sample
        for family in text_string_to_metric_families(_scrape(url, timeout_s))
        for sample in family.samples
    ]


def show_status(url: str, *, timeout_s: float = 5.0, console: Console | None = None) -> None:
    """Print sessions, open jobs, withheld staging slots, requests, refusals, block outcomes
    and mean latency."""
    rows: dict[tuple[str, str], float] = collections.defaultdict(float)
    latency: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for sample in read_metrics(url, timeout_s=timeout_s):
        name, labels = sample.name.removeprefix("kvsidecar_"), sample.labels
        if name in ("sessions", "open_jobs", "sessions_reaped_total", "staging_withheld_slots"):
            rows["sidecar", name.removesuffix("_total")] += sample.value
        elif name == "requests_total":
            rows["requests", labels["kind"]] += sample.value
        elif name == "rejected_total":
            rows["refused", labels["code"]] += sample.value
        elif name == "blocks_total":
            reason = f" ({labels['reason']})" if labels["reason"] else ""
            rows["blocks", f"{labels['path']} {labels['status']}{reason}"] += sample.value
        elif name in ("request_seconds_sum", "request_seconds_count"):
            latency[labels["kind"]][name.endswith("_count")] += sample.value
    for kind, (seconds, count) in latency.items():
        if count:
            rows["mean latency (ms)", kind] = 1000 * seconds / count
    table = Table(title=f"kvsidecar status ({url})")
    for column in ("section", "what", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for (section, what), value in sorted(rows.items()):
        table.add_row(section, what, f"{value:.0f}" if value == int(value) else f"{value:.2f}")
    (console or Console()).print(table)
