"""The CLI as a user runs it."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

KVSIDECAR = [sys.executable, "-m", "pipeline.app.cli"]
WIDE = {**os.environ, "COLUMNS": "160"}


def test_demo_verifies_every_byte_and_exits_zero() -> None:
    """`kvsidecar demo` runs a sidecar and two engines and exits 0 with a summary."""
    result = subprocess.run([*KVSIDECAR, "demo", "--requests", "16"], capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every loaded byte verified" in result.stdout
    assert "ring blocks ignored" in result.stdout


def test_serve_with_an_unknown_key_exits_2_naming_it(tmp_path: Path) -> None:
    """A config typo stops the sidecar at once with exit code 2 and the key's path."""
    config = tmp_path / "bad.yaml"
    config.write_text("stages:\n  batching:\n    max_blokcs: 3\n")
    result = subprocess.run([*KVSIDECAR, "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "max_blokcs" in result.stderr and "$.stages.batching" in result.stderr


def test_serve_refuses_insecure_tcp_beyond_loopback() -> None:
    """A tcp:// endpoint on all interfaces without authentication refuses to start."""
    result = subprocess.run([*KVSIDECAR, "serve", "--endpoint", "tcp://0.0.0.0:5599"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "allow_insecure_tcp" in result.stderr


def test_status_shows_a_running_sidecars_metrics() -> None:
    """`kvsidecar status` prints the engines, the pipeline's edges, the store and the
    traffic of a running sidecar."""
    from pipeline.testing import run_sidecar_process

    with run_sidecar_process(metrics=True) as sidecar:
        assert sidecar.metrics_url is not None
        result = subprocess.run([*KVSIDECAR, "status", "--metrics-url", sidecar.metrics_url],
                                capture_output=True, text=True, timeout=60, env=WIDE)
    assert result.returncode == 0, result.stderr
    for heading in ("engines", "pipeline", "store and staging", "traffic"):
        assert heading in result.stdout
    assert "withheld slots" in result.stdout and "closed" in result.stdout  # the breaker


def rows(output: str, what: str) -> list[list[str]]:
    """The cells of the table rows that start with ``what``."""
    return [[cell.strip() for cell in line.strip("│").split("│")]
            for line in output.splitlines() if line.startswith(f"│ {what} ")]


def cells(output: str, what: str) -> list[str]:
    (row,) = rows(output, what)
    return row


async def test_status_watch_refreshes_with_what_happened_since_the_last_refresh() -> None:
    """`kvsidecar status --watch` against a sidecar an engine is using: its groups,
    stored and ignored, and the recent request rate and bytes per second."""
    import anyio
    import anyio.to_thread

    from pipeline.testing import run_sidecar_process
    from tests.kit import KVEngine, hybrid_layout, random_tokens

    blocks = [[1, 2, 3, 4], [7], [1, 2, 3, 4]]
    with run_sidecar_process(metrics=True) as sidecar:
        assert sidecar.metrics_url is not None
        command = [*KVSIDECAR, "status", "--metrics-url", sidecar.metrics_url, "--watch",
                   "--interval", "1", "--count", "2"]
        with anyio.fail_after(60):
            async with await KVEngine(hybrid_layout()).connect(
                    sidecar.endpoint, engine_id="busy") as client:
                async with anyio.create_task_group() as tg:
                    async def use() -> None:
                        for i in itertools.count():
                            tokens = random_tokens(64, seed=i)
                            await client.save(f"r{i}", tokens, blocks)
                            await client.lookup(tokens)
                            await anyio.sleep(0.05)

                    tg.start_soon(use)
                    result = await anyio.to_thread.run_sync(lambda: subprocess.run(
                        command, capture_output=True, text=True, timeout=60, env=WIDE))
                    tg.cancel_scope.cancel()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert rows(out, "busy") == [["busy", "0", "full_attention", "16", "store group 0"],
                                 ["busy", "1", "circular_buffer", "4", "ignored"],
                                 ["busy", "2", "mamba", "16", "store group 1"]]
    # The window between two scrapes: the interval, plus however long the second scrape
    # took (a busy host was seen to take over 50 ms, shown as 1.1 s; its timeout is 5 s).
    window = re.search(r"last (\d+\.\d) s", out)
    assert window is not None and 1.0 <= float(window[1]) <= 6.0, out
    assert float(cells(out, "save requests")[2].removesuffix("/s")) > 1
    assert float(cells(out, "stored")[2].removesuffix(" MiB/s")) > 0
    # Each prompt is looked up right after its save: 48 of its 64 tokens hit (the last
    # block holds the last token, which is always recomputed).
    assert cells(out, "lookup hit rate (tokens)")[1:] == ["75.0%", "75.0%"]


def test_status_without_a_sidecar_says_what_to_check() -> None:
    """`kvsidecar status` against nothing exits 1 naming the URL and metrics.listen."""
    result = subprocess.run(
        [*KVSIDECAR, "status", "--metrics-url", "http://127.0.0.1:9/metrics"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "127.0.0.1:9" in result.stderr and "metrics.listen" in result.stderr


def test_graph_prints_every_stage_as_the_config_wires_it(tmp_path: Path) -> None:
    """`kvsidecar graph` lists each path's stages with when each waits for an item, the
    config's workers and inbox bounds, and names admission and the backends the config
    chooses."""
    config = tmp_path / "graph.yaml"
    config.write_text("stages:\n  transfer: {inbox_size: 3, workers: 5}\n"
                      "  receive: {overflow: block}\n")
    result = subprocess.run([*KVSIDECAR, "graph", "--config", str(config)],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in result.stdout.splitlines() if line.startswith("│")]
    assert [row[:2] for row in rows] == [
        ["save", "group_filter"], ["save", "hashing"], ["save", "dedup"], ["save", "batching"],
        ["save", "transfer"], ["save", "commit"], ["load", "group_filter"], ["load", "hashing"],
        ["load", "batching"], ["load", "fetch"], ["load", "scatter"], ["lookup", "lookup"],
    ]
    # Saves are handed to the transfer stage: that is where the path fills.
    assert rows[4][2:] == ["always", "5", "3", "wait (stop reading the socket)", "commit"]
    assert rows[0][2:4] == ["never", "-"] and rows[0][5] == "wait"
    assert "saves wait for room" in result.stdout
    assert "batch memory: lent by the store" in result.stdout


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staging"])
def test_graph_of_the_mooncake_config_moves_values_in_place_or_through_the_pool(
    in_place: bool, tmp_path: Path
) -> None:
    """With Mooncake, values move in place (no dedup stage: the put checks the store),
    their checksums in the staging pool as configs/mooncake.yaml sizes it; or, with
    in_place off, through that pool, after dedup."""
    config = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "configs" / "mooncake.yaml").read_text())
    config["store"]["mooncake"]["in_place"] = in_place
    path = tmp_path / "mooncake.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([*KVSIDECAR, "graph", "--config", str(path)],
                            capture_output=True, text=True, timeout=60, env=WIDE)
    assert result.returncode == 0, result.stderr
    assert "store: mooncake" in result.stdout
    if in_place:
        assert "batch memory: engine blocks moved in place" in result.stdout
        assert "dedup" not in result.stdout
    else:
        assert "batch memory: staging pool, 16 slots of 64 MiB (4 for loads)" in result.stdout
        assert "dedup" in result.stdout
