"""The benchmark report: the ratios against their goals, and the plots.

Built from the results the benchmark scripts write (``benchmarks/results/*.json``), so a
report can be redrawn from a saved ``report.json`` without measuring again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["Ratio", "markdown_table", "ratios", "write_plots"]

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Ratio:
    what: str
    value: float
    goal: str
    """``>= 0.8``, ``<= 2`` or ``== 0``."""

    @property
    def met(self) -> bool:
        op, bound = self.goal.split()
        compare: dict[str, Callable[[float, float], bool]] = {
            ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b}
        return compare[op](self.value, float(bound))


def _blocks(row: Mapping[str, Any]) -> int:
    """Blocks per request of a throughput row (its geometry is LAYERSxPAGE_KIBxBLOCKS)."""
    return int(row["geometry"].rsplit("x", 1)[1])


def _throughput(results: Mapping[str, Any]) -> Iterator[Ratio]:
    for row in results["rows"]:
        blocks = _blocks(row)
        where = (f"embedded {{}}, {blocks} blocks/request, {row['concurrency']} in flight, "
                 f"checksums {row['checksum']} (vs bare copy)")
        yield Ratio(where.format("save"), row["save_ratio"], f">= {results['goal']}")
        yield Ratio(where.format("load"), row["load_ratio"], f">= {results['goal']}")


def _lookup(results: Mapping[str, Any]) -> Iterator[Ratio]:
    for row in results["rows"]:
        if row["case"] != "hit":
            continue
        tokens = row["tokens"]
        hashes, only = f"<= {results['goal_engine_hashes']}", f"<= {results['goal_tokens_only']}"
        yield Ratio(f"lookup p50, {tokens} tokens, engine hashes (vs bare round trip)",
                    row["ratio_engine_hashes_p50"], hashes)
        yield Ratio(f"lookup p50, {tokens} tokens, tokens only (vs round trip + hash)",
                    row["ratio_p50"], only)
        # Like for like: the client polls for a lookup's reply, and so does this bare one.
        yield Ratio(f"lookup p50, {tokens} tokens, engine hashes (vs bare round trip, "
                    "both polling)", row["ratio_engine_hashes_polling_p50"], hashes)
        yield Ratio(f"lookup p50, {tokens} tokens, tokens only (vs round trip + hash, "
                    "both polling)", row["ratio_polling_p50"], only)


def _overload(results: Mapping[str, Any]) -> Iterator[Ratio]:
    offered = results["offered_over_capacity"]
    yield Ratio(f"load p99 under {offered:.1f}x the save capacity (vs unloaded p50, inside)",
                results["p99_over_unloaded_p50"], f"<= {results['goal_p99_over_unloaded_p50']}")
    yield Ratio("peak RSS under overload (vs staging + store + mapped memory)",
                results["rss"]["peak_over_bound"], "<= 1")
    yield Ratio("completions lost under overload", results["completions_lost"], "== 0")


EXTRACTORS: dict[str, Callable[[Mapping[str, Any]], Iterator[Ratio]]] = {
    "bench_sidecar_throughput": _throughput,
    "bench_lookup_latency": _lookup,
    "soak": _overload,
}


def ratios(benchmarks: Mapping[str, Mapping[str, Any]]) -> list[Ratio]:
    """Every ratio of the benchmarks that produced results, with its goal."""
    return [ratio for name, extract in EXTRACTORS.items() if name in benchmarks
            for ratio in extract(benchmarks[name])]


def markdown_table(found: list[Ratio], heading: str) -> str:
    lines = [heading, "", "| measured | ratio | goal | met |", "|---|---:|---|---|"]
    lines += [f"| {r.what} | {r.value:.2f} | {r.goal} | {'yes' if r.met else 'no'} |"
              for r in found]
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------


def _plot_throughput(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [row for row in results["rows"] if row["checksum"] == "on"] or results["rows"]
    concurrencies = sorted({row["concurrency"] for row in rows})
    figure, axes = plt.subplots(1, len(concurrencies),
                                figsize=(max(8, 6 * len(concurrencies)), 5),
                                squeeze=False, sharey=True)
    for axis, concurrency in zip(axes[0], concurrencies, strict=True):
        chosen = sorted((r for r in rows if r["concurrency"] == concurrency), key=_blocks)
        blocks = [_blocks(r) for r in chosen]
        for key, label, style in (("bare_save", "bare copy, save", "--"),
                                  ("sidecar_save", "sidecar, save", "-"),
                                  ("bare_load", "bare copy, load", "--"),
                                  ("sidecar_load", "sidecar, load", "-")):
            color = "tab:blue" if key.endswith("save") else "tab:orange"
            axis.plot(blocks, [r["gbps"][key] for r in chosen], style, marker="o",
                      color=color, label=label)
        axis.set_xscale("log", base=2)
        axis.set_xticks(blocks, [str(b) for b in blocks])
        axis.set_xlabel("blocks per request (batch size)")
        axis.set_title(f"{concurrency} request{'s' if concurrency > 1 else ''} in flight")
        axis.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("GB/s")
    axes[0][0].legend()
    layers, page_kib, _ = rows[0]["geometry"].split("x")
    figure.suptitle(f"Embedded store throughput beside a bare torch copy of the same blocks\n"
                    f"({layers} layers x {page_kib} KiB pages, checksums on)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_lookup_cdf(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for row in (r for r in results["rows"] if r["case"] == "hit"):
        color = next(colors)
        for series, label, style in (("engine_hashes", "engine hashes", "-"),
                                     ("tokens_only", "tokens only", ":"),
                                     ("bare", "bare round trip", "--")):
            samples = sorted(s * 1e6 for s in row["calls_s"][series])
            if not samples:
                continue
            axis.plot(samples, [(i + 1) / len(samples) for i in range(len(samples))], style,
                      color=color, label=f"{row['tokens']} tokens, {label}")
    axis.set_xscale("log")
    axis.set_xlabel("lookup latency (µs, log scale)")
    axis.set_ylabel("fraction of lookups")
    axis.set_title("Lookup latency CDF (hits), against a bare ZMQ round trip of the same frame")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_overload(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, (memory, latency) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    start, end = results["soak_window_s"]
    rss = results["rss"]
    memory.plot([t for t, _ in rss["samples"]], [v / MIB for _, v in rss["samples"]],
                color="tab:purple", label="sidecar RSS")
    memory.axhline(rss["bound"] / MIB, color="tab:red", linestyle="--",
                   label="bound: baseline + staging + store + mapped engine memory")
    memory.set_ylabel("MiB")
    memory.legend(fontsize="small", loc="lower right")
    timeline = results["load_timeline"]
    latency.plot([t for t, _ in timeline], [s * 1e3 for _, s in timeline], ".", markersize=3,
                 color="tab:green", label="probe engine's loads")
    unloaded = results["probe"]["unloaded_load"].get("p50_ms", math.nan)
    latency.axhline(unloaded, color="tab:gray", linestyle="--", label="unloaded p50")
    latency.axhline(2 * unloaded, color="tab:red", linestyle=":", label="2x unloaded p50")
    latency.set_yscale("log")
    latency.set_ylabel("load latency (ms, log scale)")
    latency.set_xlabel("seconds since the sidecar started")
    latency.legend(fontsize="small", loc="upper right")
    for axis in (memory, latency):
        axis.axvspan(start, end, color="tab:red", alpha=0.06)
        axis.grid(True, alpha=0.3)
    figure.suptitle(f"Under {results['offered_over_capacity']:.1f}x the save capacity "
                    f"(shaded): memory and load latency over time")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


PLOTS: dict[str, tuple[str, Callable[[Mapping[str, Any], Path], None]]] = {
    "bench_sidecar_throughput": ("throughput.png", _plot_throughput),
    "bench_lookup_latency": ("lookup_cdf.png", _plot_lookup_cdf),
    "soak": ("overload.png", _plot_overload),
}


def write_plots(benchmarks: Mapping[str, Mapping[str, Any]], directory: Path) -> list[Path]:
    """A PNG per benchmark that produced results (matplotlib, drawn off-screen)."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for name, (file, plot) in PLOTS.items():
        if name in benchmarks:
            plot(benchmarks[name], directory / file)
            written.append(directory / file)
    return written
