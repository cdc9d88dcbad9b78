"""Every command as a user runs it from a directory of their own, not the checkout's
root: relative paths are the user's, and what the command reads from the checkout it
finds all the same."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from pipeline.app.bench import run_bench
from pipeline.core.errors import KVSidecarError

KVSIDECAR = [sys.executable, "-m", "pipeline.app.cli"]
WIDE = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSIDECAR, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=WIDE)


def test_the_demo_runs_from_another_directory(tmp_path: Path) -> None:
    result = run(["demo", "--requests", "4"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every loaded byte verified" in result.stdout


def test_graph_config_keygen_status_and_explain_take_paths_relative_to_the_user(
    tmp_path: Path,
) -> None:
    """A relative config and key prefix are read and written where the user is; the
    commands that reach a sidecar say what to check when there is none."""
    (tmp_path / "mine.yaml").write_text("server: {max_peers: 7}\n"
                                        "stages:\n  transfer: {workers: 3}\n")
    graph = run(["graph", "--config", "mine.yaml"], tmp_path)
    assert graph.returncode == 0, graph.stderr
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in graph.stdout.splitlines() if line.startswith("│")]
    assert ["save", "transfer", "always", "3"] in [row[:4] for row in rows]
    shown = json.loads(run(["config", "--config", "mine.yaml", "--json"], tmp_path).stdout)
    assert shown["config"]["server.max_peers"] == {"value": 7, "source": "file"}
    assert shown["effective"]["stages.transfer.workers"] == {"value": 3, "source": "tuning"}
    keys = run(["keygen", "--out", "k"], tmp_path)
    assert keys.returncode == 0, keys.stderr
    assert (tmp_path / "k.key").exists() and (tmp_path / "k.key.pub").exists()
    status = run(["status", "--metrics-url", "http://127.0.0.1:9/metrics"], tmp_path)
    assert status.returncode == 1 and "metrics.listen" in status.stderr
    assert run(["explain", "--help"], tmp_path).returncode == 0


def test_serve_reads_a_relative_config_and_stops_cleanly(tmp_path: Path) -> None:
    """`serve --config FILE` with FILE relative to the user's directory starts, binds its
    endpoint and exits 0 on SIGTERM; an old key in it is logged with its replacement."""
    socket = tmp_path / "s.sock"
    (tmp_path / "mine.yaml").write_text(f"server:\n  endpoint: ipc://{socket}\n"
                                        "metrics: {port: 0}\n")
    process = subprocess.Popen([*KVSIDECAR, "serve", "--config", "mine.yaml"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=WIDE)
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the sidecar never bound its endpoint"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "sidecar.stopped" in output
    assert "config.deprecated" in output and "metrics.listen" in output


def test_bench_quick_writes_its_report_where_the_user_asked(tmp_path: Path) -> None:
    """`bench --quick --out DIR` from elsewhere: every benchmark runs (they run in the
    checkout, handed absolute paths) and the report lands in the user's DIR."""
    result = run(["bench", "--quick", "--out", "results-here"], tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "results-here" / "report.json").read_text())
    assert all(step["produced_results"] for step in report["runs"].values()), report["runs"]


def test_bench_without_the_checkouts_scripts_says_to_run_it_from_one(tmp_path: Path) -> None:
    """Installed without the checkout, the benchmarks are not there: the command says so."""
    with pytest.raises(KVSidecarError, match="run it from a source checkout"):
        run_bench(quick=True, out=tmp_path / "out", scripts=tmp_path / "no-benchmarks",
                  console=Console(quiet=True))
