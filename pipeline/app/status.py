"""``kvsidecar status [--watch]``: a running sidecar as its Prometheus endpoint shows it.

One scrape gives totals; watching, each refresh also shows what happened since the last
one (rates, hit rate, queue waits), refreshed in place.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table

from pipeline.core.errors import TransportError

__all__ = ["Buckets", "Snapshot", "histogram_quantile", "read_metrics", "render", "show_status"]

Buckets = list[tuple[float, float]]
"""A Prometheus histogram: (upper bound, cumulative count), ascending, +Inf last."""


def _scrape(url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: bytes = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise TransportError(
            f"cannot read {url}: {exc}; is the sidecar running with metrics.listen set?"
        ) from exc
    return body.decode()


def read_metrics(url: str, *, timeout_s: float = 5.0) -> list[Sample]:
    """Every sample a sidecar's Prometheus endpoint serves now."""
    return [
        sample
        for family in text_string_to_metric_families(_scrape(url, timeout_s))
        for sample in family.samples
    ]


def histogram_quantile(q: float, after: Buckets, before: Buckets | None = None) -> float:
    """The q-quantile (0..1) of what a histogram counted between two scrapes, linearly
    interpolated inside its bucket (as PromQL's histogram_quantile does); NaN when it
    counted nothing. An empty ``before`` is a histogram that had counted nothing yet."""
    counts = [(bound, count - (before[i][1] if before else 0))
              for i, (bound, count) in enumerate(after)]
    total = counts[-1][1] if counts else 0
    if total <= 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One scrape, and when it was taken (monotonic seconds)."""

    samples: list[Sample]
    at: float = dataclasses.field(default_factory=time.monotonic)

    def by(self, name: str, *labels: str, **match: str) -> dict[tuple[str, ...], float]:
        """Sums of ``name``'s samples whose labels include ``match``, by ``labels``."""
        found: dict[tuple[str, ...], float] = collections.defaultdict(float)
        for sample in self.samples:
            if sample.name == name and match.items() <= sample.labels.items():
                found[tuple(sample.labels.get(label, "") for label in labels)] += sample.value
        return found

    def total(self, name: str, **match: str) -> float:
        return sum(self.by(name, **match).values())

    def buckets(self, name: str, **match: str) -> Buckets:
        return sorted((float(le), count) for (le,), count
                      in self.by(f"{name}_bucket", "le", **match).items())


def _since(now: Snapshot, before: Snapshot | None, name: str, **match: str) -> float:
    return now.total(name, **match) - (before.total(name, **match) if before else 0.0)


def _quantiles(now: Snapshot, before: Snapshot | None, name: str, **match: str) -> str:
    after = now.buckets(name, **match)
    earlier = before.buckets(name, **match) if before else None
    p50, p99 = (histogram_quantile(q, after, earlier or None) for q in (0.5, 0.99))
    return "-" if math.isnan(p50) else f"{p50 * 1e3:.2f} / {p99 * 1e3:.2f}"


def _table(title: str, columns: Iterable[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    return table


def _engines(now: Snapshot) -> Table:
    table = _table("engines", ("engine", "kv-cache group", "kind", "block size", "stored as"))
    groups = now.by("kvsidecar_engine_group", "engine_id", "kv_group", "kind", "block_size",
                    "store_group")
    for (engine, kv_group, kind, block_size, store_group), stored in sorted(groups.items()):
        table.add_row(engine, kv_group, kind, block_size,
                      f"store group {store_group}" if stored else "ignored")
    return table


def _edges(now: Snapshot, before: Snapshot | None) -> Table:
    span = "since last refresh" if before else "since start"
    table = _table("pipeline", ("path", "stage", "queued", "inbox", "items",
                                f"wait p50 / p99 ms ({span})"))
    capacity = now.by("kvsidecar_edge_capacity", "path", "stage")
    queued = now.by("kvsidecar_edge_queued", "path", "stage")
    for (path, stage), size in capacity.items():
        items = _since(now, before, "kvsidecar_edge_wait_seconds_count", path=path, stage=stage)
        table.add_row(path, stage, f"{queued.get((path, stage), 0):.0f}", f"{size:.0f}",
                      f"{items:.0f}",
                      _quantiles(now, before, "kvsidecar_edge_wait_seconds", path=path,
                                 stage=stage))
    return table


def _store(now: Snapshot) -> Table:
    table = _table("store and staging", ("what", "value"))
    capacity = now.total("kvsidecar_store_capacity_bytes")
    if capacity:
        used = now.total("kvsidecar_store_used_bytes")
        table.add_row("store fill", f"{used / 2**20:.1f} / {capacity / 2**20:.0f} MiB "
                                    f"({100 * used / capacity:.1f}%)")
        table.add_row("evictions", f"{now.total('kvsidecar_store_evictions_total'):.0f}")
    read_here = now.by("kvsidecar_store_values_read_here_total", "outcome")
    if read_here:  # Mooncake: loads of values in the sidecar's own segment
        table.add_row("values loads read where they lie",
                      f"{read_here.get(('loaded',), 0):.0f} "
                      f"({read_here.get(('lease_expired',), 0):.0f} failed, past their lease)")
    _disk(now, table)
    breaker = [state for (state,), on in now.by("kvsidecar_store_breaker", "state").items() if on]
    table.add_row("breaker", ", ".join(breaker) or "-")
    slots = now.by("kvsidecar_staging_slots", "lane", "use")
    for lane in ("save", "load"):
        table.add_row(f"staging ({lane}s)", f"{slots.get((lane, 'used'), 0):.0f} / "
                                            f"{slots.get((lane, 'total'), 0):.0f} slots in use")
    table.add_row("withheld slots", f"{now.total('kvsidecar_staging_withheld_slots'):.0f}")
    for name, what in (("kvsidecar_sessions", "engines"), ("kvsidecar_open_jobs", "open jobs"),
                       ("kvsidecar_copies_in_flight", "copies in flight"),
                       ("kvsidecar_sessions_reaped_total", "engines reaped")):
        table.add_row(what, f"{now.total(name):.0f}")
    return table


def _disk(now: Snapshot, table: Table) -> None:
    """The disk tier's rows, if it has one."""
    capacity = now.total("kvsidecar_disk_capacity_bytes")
    if not capacity:
        return
    used = now.total("kvsidecar_disk_used_bytes")
    state = "on" if now.total("kvsidecar_disk_enabled") else "OFF (a disk error; see the log)"
    table.add_row("disk tier", state)
    table.add_row("disk fill", f"{used / 2**30:.2f} / {capacity / 2**30:.2f} GiB "
                               f"({100 * used / capacity:.1f}%), "
                               f"{now.total('kvsidecar_disk_values'):.0f} values")
    table.add_row("disk writes, reads",
                  f"{now.total('kvsidecar_disk_writes_total'):.0f} "
                  f"({now.total('kvsidecar_disk_written_bytes_total') / 2**20:.0f} MiB), "
                  f"{now.total('kvsidecar_disk_reads_total'):.0f} "
                  f"({now.total('kvsidecar_disk_read_bytes_total') / 2**20:.0f} MiB)")
    dropped = now.total("kvsidecar_disk_dropped_total")
    table.add_row("disk skipped, errors, dropped",
                  f"{now.total('kvsidecar_disk_skipped_total'):.0f}, "
                  f"{now.total('kvsidecar_disk_errors_total'):.0f}, {dropped:.0f}")


def _traffic(now: Snapshot, before: Snapshot | None) -> Table:
    seconds = now.at - before.at if before else 0.0
    table = _table("traffic", ("what", "since start",
                               f"last {seconds:.1f} s" if before else ""))

    def row(what: str, since_start: str, recent: str = "") -> None:
        table.add_row(what, since_start, recent if before else "")

    def hit_rate(earlier: Snapshot | None) -> str:
        queried = _since(now, earlier, "kvsidecar_lookup_tokens_total", kind="queried")
        hit = _since(now, earlier, "kvsidecar_lookup_tokens_total", kind="hit")
        return f"{100 * hit / queried:.1f}%" if queried else "-"

    row("lookup hit rate (tokens)", hit_rate(None), hit_rate(before))
    for what, path, via in (("stored", "save", "store"), ("loaded", "load", "copy")):
        moved = _since(now, None, "kvsidecar_bytes_total", path=path, via=via)
        recent = _since(now, before, "kvsidecar_bytes_total", path=path, via=via)
        row(what, f"{moved / 2**20:.1f} MiB",
            f"{recent / 2**20 / seconds:.1f} MiB/s" if seconds else "")
    for (kind,), count in sorted(now.by("kvsidecar_requests_total", "kind").items()):
        recent = _since(now, before, "kvsidecar_requests_total", kind=kind)
        row(f"{kind} requests", f"{count:.0f}", f"{recent / seconds:.1f}/s" if seconds else "")
    for (kind,) in sorted(now.by("kvsidecar_request_seconds_count", "kind")):
        row(f"{kind} latency p50 / p99 ms", _quantiles(now, None, "kvsidecar_request_seconds",
                                                       kind=kind),
            _quantiles(now, before, "kvsidecar_request_seconds", kind=kind))
    for (path, status, reason), count in sorted(
            now.by("kvsidecar_blocks_total", "path", "status", "reason").items()):
        recent = _since(now, before, "kvsidecar_blocks_total", path=path, status=status,
                        reason=reason)
        row(f"{path} blocks {status}" + (f" ({reason})" if reason else ""), f"{count:.0f}",
            f"{recent:.0f}")
    for (code,), count in sorted(now.by("kvsidecar_rejected_total", "code").items()):
        recent = _since(now, before, "kvsidecar_rejected_total", code=code)
        row(f"refused ({code})", f"{count:.0f}", f"{recent:.0f}")
    for (request,), count in sorted(now.by("kvsidecar_cancels_total", "request").items()):
        recent = _since(now, before, "kvsidecar_cancels_total", request=request)
        row(f"cancels ({request.replace('_', ' ')} request)", f"{count:.0f}", f"{recent:.0f}")
    for name, what in (("kvsidecar_deadlines_missed", "deadlines missed"),
                       ("kvsidecar_late_completions_total", "completions past deadline")):
        if now.by(name):
            row(what, f"{now.total(name):.0f}", f"{_since(now, before, name):.0f}")
    return table


def render(now: Snapshot, before: Snapshot | None = None, *, title: str = "") -> RenderableType:
    """The status view of one scrape; with an earlier one, also what changed since."""
    return Group(*([title] if title else []), _engines(now), _edges(now, before),
                 _store(now), _traffic(now, before))


def show_status(url: str, *, watch: bool = False, interval_s: float = 2.0, count: int = 0,
                timeout_s: float = 5.0, console: Console | None = None) -> None:
    """Print the status view once, or (``watch``) refresh it in place every
    ``interval_s`` until interrupted or ``count`` refreshes (0: no limit)."""
    console = console or Console()
    title = f"kvsidecar status ({url})"
    now = Snapshot(read_metrics(url, timeout_s=timeout_s))
    if not watch:
        console.print(render(now, title=title))
        return
    with Live(render(now, title=title), console=console, auto_refresh=False) as live:
        refreshes = 0
        while not count or refreshes < count:
            time.sleep(interval_s)
            before, now = now, Snapshot(read_metrics(url, timeout_s=timeout_s))
            live.update(render(now, before, title=title), refresh=True)
            refreshes += 1
