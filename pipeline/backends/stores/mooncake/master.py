"""An embedded ``mooncake_master`` on loopback, serving its own HTTP metadata server.

The master is a child process in its own process group, so a terminal's Ctrl-C reaches
the sidecar only and the sidecar decides when the master goes. On Linux the child also
asks the kernel for ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG``), so a
sidecar killed with ``SIGKILL`` leaves no orphan master and no listening port behind.
The kernel sends that signal when the *thread* that forked the child exits, which is
why the master is spawned from the event loop thread and never from a worker thread.

Its output goes to a file (``store.mooncake.master_log``, or an unlinked temporary file
that vanishes with the last descriptor, even after a SIGKILL) rather than a pipe, which
would stall the master once nobody drained it. Startup errors quote its tail.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import anyio
import anyio.to_thread
import psutil
import structlog
from anyio.abc import AsyncResource

from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.errors import StoreError

__all__ = [
    "EmbeddedMaster",
    "MasterEndpoints",
    "find_master_binary",
    "open_embedded_master",
]

log = structlog.get_logger("kvsidecar.store.mooncake")

LOOPBACK = "127.0.0.1"
TERMINATE_GRACE_S = 3.0
_POLL_INTERVAL_S = 0.02
_LOG_TAIL_BYTES = 2000
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class MasterEndpoints:
    """Where Mooncake clients find a master and its metadata server."""

    master_address: str
    """``host:port`` of the master's RPC service."""
    metadata_server: str
    """URL of the metadata server (``http://host:port/metadata``)."""


class EmbeddedMaster(AsyncResource):
    """A running ``mooncake_master`` child process; ``aclose()`` stops it, idempotently."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        endpoints: MasterEndpoints,
        log_file: IO[bytes],
    ) -> None:
        self._process = process
        self.endpoints = endpoints
        self._log_file = log_file
        self._closed = False

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.poll()

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        """The end of the master's output (blocking file I/O: call it from a thread)."""
        try:
            fd = self._log_file.fileno()
            size = os.fstat(fd).st_size
            return os.pread(fd, limit, max(0, size - limit)).decode(errors="replace")
        except (OSError, ValueError) as exc:  # ValueError: already closed
            return f"<log unreadable: {exc}>"

    async def aclose(self) -> None:
        """Stop the master: SIGTERM to its process group, SIGKILL after a short grace."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            returncode = await _terminate(self._process, TERMINATE_GRACE_S)
            self._log_file.close()
        log.info("store.mooncake.master.stopped", pid=self.pid, returncode=returncode)


def find_master_binary(name: str) -> str:
    """Resolve ``store.mooncake.master_binary``: a path, or a name on PATH or beside Python."""
    if os.sep in name:
        found = name if os.access(name, os.X_OK) else None
    else:
        search = os.pathsep.join(
            filter(None, [os.environ.get("PATH"), str(Path(sys.executable).parent)])
        )
        found = shutil.which(name, path=search)
    if found is None:
        raise StoreError(
            f"mooncake_master not found (store.mooncake.master_binary={name!r}): install "
            "mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine on CUDA hosts) "
            "in this environment, or point master_binary at the binary"
        )
    return found


async def open_embedded_master(config: MooncakeStoreConfig) -> EmbeddedMaster:
    """Start ``mooncake_master`` on loopback and wait until it accepts connections."""
    binary = find_master_binary(config.master_binary)
    rpc_port = config.master_port or _free_port()
    metadata_port = config.metadata_port or _free_port()
    metrics_port = _free_port()
    endpoints = MasterEndpoints(
        master_address=f"{LOOPBACK}:{rpc_port}",
        metadata_server=f"http://{LOOPBACK}:{metadata_port}/metadata",
    )
    command = [
        binary,
        f"--rpc_address={LOOPBACK}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={LOOPBACK}",
        f"--http_metadata_server_port={metadata_port}",
        f"--metrics_host={LOOPBACK}",
        f"--metrics_port={metrics_port}",
        "--enable_metric_reporting=false",
        f"--default_kv_lease_ttl={config.kv_lease_ttl_ms}",
        f"--eviction_high_watermark_ratio={config.eviction_high_watermark}",
        f"--eviction_ratio={config.eviction_ratio}",
    ]
    log_file = _open_log(config.master_log)
    try:
        # Spawned here, on the event loop thread: see the module docstring.
        process = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, it does not wait
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent_hook(),
        )
    except OSError as exc:
        log_file.close()
        raise StoreError(f"cannot start {binary}: {exc}") from exc
    master = EmbeddedMaster(process, endpoints, log_file)
    try:
        await _wait_until_serving(master, (rpc_port, metadata_port), config.startup_timeout_s)
    except BaseException:
        await master.aclose()
        raise
    log.info(
        "store.mooncake.master.started",
        pid=process.pid,
        master=endpoints.master_address,
        metadata_server=endpoints.metadata_server,
        log=config.master_log or None,
    )
    return master


async def _wait_until_serving(
    master: EmbeddedMaster, ports: tuple[int, ...], timeout_s: float
) -> None:
    # Asks the kernel which sockets the child itself listens on: a connect() test would
    # also succeed against another process that holds the port.
    with anyio.move_on_after(timeout_s):
        while True:
            if master.returncode is not None:
                tail = await anyio.to_thread.run_sync(master.log_tail)
                raise StoreError(
                    f"mooncake_master exited with code {master.returncode} during startup "
                    f"(ports {', '.join(map(str, ports))} in use?); its log ends with:\n{tail}"
                )
            listening = await anyio.to_thread.run_sync(_listening_ports, master.pid)
            if listening.issuperset(ports):
                return
            await anyio.sleep(_POLL_INTERVAL_S)
    tail = await anyio.to_thread.run_sync(master.log_tail)
    raise StoreError(
        f"mooncake_master did not listen on {LOOPBACK} ports {list(ports)} within "
        f"{timeout_s}s (store.mooncake.startup_timeout_s; ports taken by another process?); "
        f"its log ends with:\n{tail}"
    )


def _listening_ports(pid: int) -> set[int]:
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return set()
    return {conn.laddr.port for conn in connections if conn.status == psutil.CONN_LISTEN}


async def _terminate(process: subprocess.Popen[bytes], grace_s: float) -> int:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # Only a child not yet reaped still owns its pid: check before signalling.
        if process.poll() is not None:
            break
        os.killpg(process.pid, sig)
        try:
            return await anyio.to_thread.run_sync(functools.partial(process.wait, grace_s))
        except subprocess.TimeoutExpired:
            continue
    return await anyio.to_thread.run_sync(process.wait)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _open_log(path: str) -> IO[bytes]:
    try:
        return open(path, "a+b") if path else tempfile.TemporaryFile(prefix="mooncake-master-")
    except OSError as exc:
        raise StoreError(
            f"cannot open the master's log {path!r} (store.mooncake.master_log): {exc.strerror}"
        ) from exc


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook
