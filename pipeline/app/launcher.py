"""The one sidecar launcher: ``kvsidecar serve`` in a child process, on a private
endpoint, ready when it says so. Tests, benchmarks, the demo and engine integrations
all start sidecars through it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.samples import Sample

from pipeline.app.status import read_metrics
from pipeline.core.config import merge, read_config
from pipeline.core.config.migrate import split_operator_keys

__all__ = ["SidecarProcess", "free_port", "run_sidecar_process"]


class SidecarProcess:
    """A ``kvsidecar serve`` child process on a private ipc:// endpoint."""

    def __init__(self, process: subprocess.Popen[bytes], endpoint: str, log_path: Path,
                 metrics_url: str | None = None) -> None:
        self.process = process
        self.endpoint = endpoint
        self.log_path = log_path
        self.metrics_url = metrics_url
        """Its Prometheus endpoint, when started with ``metrics=True``."""

    def metrics(self) -> list[Sample]:
        """Every metric sample the sidecar serves now (it must run with ``metrics=True``)."""
        if self.metrics_url is None:
            raise RuntimeError("this sidecar was started without metrics (metrics=True)")
        return read_metrics(self.metrics_url)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        """What the sidecar has written so far: a line is written some milliseconds
        after it is logged (``final_log`` waits for every line)."""
        return self.log_path.read_text(errors="replace")

    def final_log(self, timeout_s: float = 30.0) -> str:
        """Stop the sidecar (``terminate``: it writes every line as it exits), then its
        whole log."""
        self.terminate(timeout_s)
        return self.log()

    def wait_log(self, until: Callable[[str], bool], timeout_s: float = 10.0) -> str:
        """The log once ``until(log)`` holds, or as it is after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not until(log := self.log()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return log

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def run_sidecar_process(
    overrides: Mapping[str, Any] | None = None,
    *,
    config: str | Path | None = None,
    python_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 30.0,
    stop_timeout_s: float = 15.0,
    metrics: bool = False,
) -> Iterator[SidecarProcess]:
    """Start a sidecar with ``config`` (a YAML file; default: the built-in defaults) plus
    ``overrides`` (a nested dict), on a fresh ipc:// endpoint. The file is read as
    ``kvsidecar serve`` reads it (old keys migrated); of the overrides, operator keys go
    to the sidecar's config file and everything else (fault points, constants, old keys,
    in the effective tree's shape) to its ``--test-config``.

    ``python_args`` go before ``-m`` (``["-m", "cProfile", "-o", FILE]`` profiles it).
    ``metrics``: serve Prometheus metrics on a free loopback port (``metrics_url``).
    The sidecar is stopped (SIGTERM, then SIGKILL) when the block exits.

    It runs in a session of its own, as under a service manager: where the kernel groups
    processes by session (Linux's autogroup), the CPU is shared between the sidecar and
    the engines that start it as two groups, not thread by thread, so engines busy on
    the same cores cannot crowd the sidecar out. A terminal's Ctrl-C reaches the caller
    alone, which stops the sidecar on its way out.
    """
    metrics_url = None
    if metrics:
        port = free_port()
        overrides = merge({"metrics": {"host": "127.0.0.1", "port": port}}, overrides or {})
        metrics_url = f"http://127.0.0.1:{port}/metrics"
    with tempfile.TemporaryDirectory(prefix="kvsidecar-") as tmp:
        socket_path = Path(tmp) / "sidecar.sock"
        # The user's file as ``kvsidecar serve`` reads it (old keys migrated, errors
        # naming it), then the overrides, split by who may set them.
        given = read_config(config) if config else None
        operator, tuning = split_operator_keys(
            merge({"server": {"endpoint": f"ipc://{socket_path}"}}, overrides or {}))
        operator = merge(given.written if given else {}, operator)
        tuning = merge(merge({"logging": {"format": "json"}}, given.tuning if given else {}),
                       tuning)
        config_path = Path(tmp) / "config.yaml"
        config_path.write_bytes(msgspec.yaml.encode(operator))
        test_config_path = Path(tmp) / "test-config.yaml"
        test_config_path.write_bytes(msgspec.yaml.encode(tuning))
        read_config(config_path, test_config=test_config_path)  # fail here, in the caller
        log_path = Path(tmp) / "sidecar.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, *python_args, "-m", "pipeline.app.cli", "serve",
                 "--config", str(config_path), "--test-config", str(test_config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        sidecar = SidecarProcess(process, operator["server"]["endpoint"], log_path,
                                 metrics_url)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while b"sidecar.ready" not in log_path.read_bytes():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"sidecar exited with {process.returncode}:\n{sidecar.log()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"sidecar not ready in {startup_timeout_s}s:\n{sidecar.log()}"
                    )
                time.sleep(0.02)
            yield sidecar
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                sidecar.terminate(timeout_s=stop_timeout_s)
