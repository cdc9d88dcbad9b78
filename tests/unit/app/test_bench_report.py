"""The benchmark report: ratios against their goals, the summary table, and the plots."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from pipeline.app.bench_report import Ratio, markdown_table, ratios, write_plots


def throughput() -> dict[str, Any]:
    rows = []
    for blocks in (4, 16):
        for concurrency in (1, 4):
            bare, side = 10.0, 2.0 + blocks / 8
            rows.append({"geometry": f"8x48x{blocks}", "checksum": "on",
                         "concurrency": concurrency,
                         "gbps": {"bare_save": bare, "sidecar_save": side,
                                  "bare_load": bare, "sidecar_load": 9.0},
                         "save_ratio": side / bare, "load_ratio": 0.9})
    return {"goal": 0.8, "rows": rows}


def lookup() -> dict[str, Any]:
    calls = {"bare": [1e-4, 2e-4], "tokens_only": [5e-4, 6e-4], "engine_hashes": [3e-4, 4e-4]}
    return {"goal_tokens_only": 1.3, "goal_engine_hashes": 2.0, "rows": [
        {"case": "hit", "tokens": 1024, "ratio_p50": 1.5, "ratio_engine_hashes_p50": 1.9,
         "ratio_polling_p50": 2.5, "ratio_engine_hashes_polling_p50": 3.0, "calls_s": calls},
        {"case": "miss", "tokens": 1024, "ratio_p50": 1.0, "ratio_engine_hashes_p50": 1.0,
         "ratio_polling_p50": 1.0, "ratio_engine_hashes_polling_p50": 1.0, "calls_s": calls}]}


def soak() -> dict[str, Any]:
    return {"offered_over_capacity": 9.5, "p99_over_unloaded_p50": 3.0,
            "goal_p99_over_unloaded_p50": 2.0, "completions_lost": 0,
            "soak_window_s": [2.0, 6.0],
            "rss": {"peak_over_bound": 0.8, "bound": 600 * 2**20,
                    "samples": [(t * 0.5, (300 + 10 * t) * 2**20) for t in range(16)]},
            "load_timeline": [(1.0 + t * 0.1, 0.002 + 0.01 * (2 < 1 + t * 0.1 < 6))
                              for t in range(60)],
            "probe": {"unloaded_load": {"p50_ms": 2.0}}}


def test_ratios_name_each_figure_with_its_goal_and_whether_it_is_met() -> None:
    """Throughput rows give a save and a load ratio each; lookups only their hits (against
    the bare round trip, and against one that polls as the client does); the soak its
    latency, memory and lost completions, each judged against its goal."""
    found = ratios({"bench_sidecar_throughput": throughput(), "bench_lookup_latency": lookup(),
                    "soak": soak()})
    assert len(found) == 8 + 4 + 3
    by_what = {r.what: r for r in found}
    save = by_what["embedded save, 16 blocks/request, 4 in flight, checksums on (vs bare copy)"]
    assert (save.value, save.goal, save.met) == (0.4, ">= 0.8", False)
    hashes = by_what["lookup p50, 1024 tokens, engine hashes (vs bare round trip)"]
    assert (hashes.goal, hashes.met) == ("<= 2.0", True)
    assert not by_what["lookup p50, 1024 tokens, tokens only (vs round trip + hash)"].met
    polling = by_what["lookup p50, 1024 tokens, engine hashes (vs bare round trip, both polling)"]
    assert (polling.value, polling.met) == (3.0, False)
    assert by_what["completions lost under overload"].met
    assert not ratios({})  # a benchmark that produced nothing adds nothing


def test_the_summary_is_a_markdown_table_under_its_heading() -> None:
    """One row per ratio, with its value to two places and whether it met its goal."""
    text = markdown_table([Ratio("a", 0.91, ">= 0.8"), Ratio("b", 3.0, "<= 2")], "Measured X")
    assert text.splitlines() == ["Measured X", "", "| measured | ratio | goal | met |",
                                 "|---|---:|---|---|", "| a | 0.91 | >= 0.8 | yes |",
                                 "| b | 3.00 | <= 2 | no |"]


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def test_each_benchmark_with_results_gets_its_plot(tmp_path: Path) -> None:
    """Throughput against batch size, the lookup CDF and the overload timeline are drawn
    as PNGs of a readable size; a benchmark without results draws nothing."""
    written = write_plots({"bench_sidecar_throughput": throughput(),
                           "bench_lookup_latency": lookup(), "soak": soak()}, tmp_path)
    assert [p.name for p in written] == ["throughput.png", "lookup_cdf.png", "overload.png"]
    for path in written:
        width, height = png_size(path)
        assert width >= 800 and height >= 450
        assert path.stat().st_size > 20_000  # drawn, not blank
    assert write_plots({"soak": soak()}, tmp_path / ".") == [tmp_path / "overload.png"]
