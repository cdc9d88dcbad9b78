"""Opening a Mooncake store: import the client, reach (or start) the master, mount a
segment. Every step fails fast with an error that says what to check."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
import urllib.parse
import urllib.request
from contextlib import AsyncExitStack
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import structlog

from pipeline.backends.stores.mooncake.codes import OK
from pipeline.backends.stores.mooncake.master import MasterEndpoints, open_embedded_master
from pipeline.backends.stores.mooncake.store import MooncakeClient, MooncakeStore
from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.errors import ConfigError, StoreError

__all__ = ["LIBIBVERBS_HINT", "open_mooncake_store", "replicate"]

log = structlog.get_logger("kvsidecar.store.mooncake")

_LIBC = ctypes.CDLL(None, use_errno=True)
PAGE_BYTES = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23
"""``madvise`` advice (Linux 5.14): fault pages in as if written, their bytes kept."""
PREFAULT_CHUNK_BYTES = 256 << 20
"""Faulted in per call, so that a start cancelled meanwhile stops within one."""

LIBIBVERBS_HINT = "install Debian's libibverbs1 (apt-get install -y libibverbs1)"


async def open_mooncake_store(config: MooncakeStoreConfig) -> MooncakeStore:
    """Connect to a Mooncake cluster (or start an embedded master) and mount a segment."""
    store_module = await anyio.to_thread.run_sync(_import_mooncake)
    async with AsyncExitStack() as stack:
        master = None
        if config.master == "embedded":
            master = await open_embedded_master(config)
            stack.push_async_callback(master.aclose)
            endpoints = master.endpoints
        else:
            endpoints = _remote_endpoints(config)
            await _probe(endpoints.master_address, "master", config)
            metadata = urllib.parse.urlsplit(endpoints.metadata_server)
            if metadata.scheme in ("http", "https") and metadata.hostname:
                default_port = 443 if metadata.scheme == "https" else 80
                address = f"{metadata.hostname}:{metadata.port or default_port}"
                await _probe(address, "metadata server", config)
        client = await _setup_client(store_module, config, endpoints)
        # Asked before anything else is registered: the segment, and the client's own
        # transfer buffer, are all the metadata lists of this client yet.
        memory = await _segment_here(config, endpoints, client)
        await _prefault(_segment_of(memory, config))
        here = memory if config.in_place and config.read_here else []
        if here:
            log.info("store.mooncake.read_here.on", bytes=sum(end - start for start, end in here))
        replicate_config = replicate(store_module, config, client)
        store = MooncakeStore(
            client,
            config,
            replicate_config=replicate_config,
            master_address=endpoints.master_address,
            master=master,
            here=here,
        )
        stack.pop_all()
    log.info(
        "store.mooncake.opened",
        master=endpoints.master_address,
        metadata_server=endpoints.metadata_server,
        segment_bytes=config.global_segment_bytes,
        preferred_segment=replicate_config.preferred_segment,
        embedded=master is not None,
    )
    return store


def replicate(store_module: Any, config: MooncakeStoreConfig, client: Any) -> Any:
    """The ``ReplicateConfig`` of every put: ``replica_num`` replicas, in the preferred
    segment while it has room (``local``: the client's own, a copy with no network)."""
    replicate_config = store_module.ReplicateConfig()
    replicate_config.replica_num = config.replica_num
    segment = config.preferred_segment
    if segment == "local":
        segment = client.get_hostname()
    if segment:
        replicate_config.preferred_segment = segment
    return replicate_config


class _Buffer(msgspec.Struct):
    addr: int
    length: int


class _SegmentDescriptor(msgspec.Struct):
    """The part of a client's published segment descriptor read here."""

    buffers: list[_Buffer]


async def _segment_here(config: MooncakeStoreConfig, endpoints: MasterEndpoints,
                        client: MooncakeClient) -> list[tuple[int, int]]:
    """Where this client's memory registered with Mooncake lies, its segment among it, as
    ``[start, end)`` ranges: from the descriptor the client published on an HTTP metadata
    server. Empty when there is none to ask or it cannot say: loads then move through
    Mooncake's get (``MooncakeStore``), and the segment is not faulted in at start."""
    server = urllib.parse.urlsplit(endpoints.metadata_server)
    if server.scheme not in ("http", "https"):
        log.info("store.mooncake.segment.unknown", reason="the metadata server is not HTTP",
                 metadata_server=endpoints.metadata_server)
        return []
    key = urllib.parse.quote(f"mooncake/ram/{client.get_hostname()}", safe="")
    url = f"{endpoints.metadata_server}?key={key}"

    def ask() -> list[tuple[int, int]]:
        with urllib.request.urlopen(url, timeout=config.call_timeout_s) as reply:
            segment = msgspec.json.decode(reply.read(), type=_SegmentDescriptor)
        return [(buffer.addr, buffer.addr + buffer.length) for buffer in segment.buffers]

    try:
        here = await anyio.to_thread.run_sync(ask)
    except (OSError, msgspec.MsgspecError) as exc:
        log.warning("store.mooncake.segment.unknown", metadata_server=endpoints.metadata_server,
                    reason=f"the client's segment descriptor cannot be read: {exc}")
        return []
    return here


def _segment_of(memory: list[tuple[int, int]], config: MooncakeStoreConfig
                ) -> list[tuple[int, int]]:
    """The segment's ranges among the client's memory: all but its own transfer buffer,
    told apart by its size (``local_buffer_bytes``); both where the sizes are equal."""
    if config.local_buffer_bytes == config.global_segment_bytes:
        return memory
    return [(start, end) for start, end in memory
            if end - start != config.local_buffer_bytes]


async def _prefault(ranges: list[tuple[int, int]]) -> None:
    """Fault the segment's pages in, writable, without changing a byte (Linux's
    ``MADV_POPULATE_WRITE``), as the embedded store touches its arena at start. Mooncake
    leaves its segment untouched, so each put into a page never written before took a
    page fault, and a fresh sidecar's puts ran about 5x slower (4 MiB: 6 ms against 1.2
    ms) until it had filled its segment once. Other clients may already be putting into
    the segment: the bytes they write are kept."""
    started = time.monotonic()
    faulted = 0
    try:
        for start, end in ranges:
            first, last = -(-start // PAGE_BYTES) * PAGE_BYTES, end // PAGE_BYTES * PAGE_BYTES
            for at in range(first, last, PREFAULT_CHUNK_BYTES):
                size = min(PREFAULT_CHUNK_BYTES, last - at)
                await anyio.to_thread.run_sync(_populate_write, at, size)
                faulted += size
    except OSError as exc:  # a kernel before 5.14, or no memory left for it
        log.warning("store.mooncake.segment.prefault_failed", faulted_bytes=faulted,
                    error=str(exc))
        return
    if faulted:
        log.info("store.mooncake.segment.prefaulted", bytes=faulted,
                 seconds=round(time.monotonic() - started, 3))


def _populate_write(address: int, size: int) -> None:
    """Fault ``size`` bytes at ``address`` (page-aligned) in as if written, keeping
    their bytes; in a worker thread (ctypes lets the GIL go)."""
    if _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_POPULATE_WRITE):
        code = ctypes.get_errno()
        raise OSError(code, f"madvise(MADV_POPULATE_WRITE): {os.strerror(code)}"
                      + (" (Linux 5.14 or later has it)" if code == errno.EINVAL else ""))


def _import_mooncake() -> Any:
    try:
        import mooncake.store as store_module
    except (ImportError, OSError) as exc:
        if "libibverbs" in str(exc):
            raise StoreError(f"cannot load the Mooncake client ({exc}): {LIBIBVERBS_HINT}") from exc
        raise StoreError(
            f"cannot import mooncake.store ({exc}): install mooncake-transfer-engine-non-cuda "
            "(or mooncake-transfer-engine on CUDA hosts), e.g. pip install 'kvsidecar[mooncake]'"
        ) from exc
    return store_module


def _remote_endpoints(config: MooncakeStoreConfig) -> MasterEndpoints:
    host, sep, port = config.master.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"store.mooncake.master must be 'embedded' or host:port, not {config.master!r}"
        )
    if not config.metadata_server:
        raise ConfigError(
            "store.mooncake.metadata_server is required with a remote master "
            f"({config.master}): the URL of the cluster's metadata server"
        )
    return MasterEndpoints(master_address=config.master, metadata_server=config.metadata_server)


async def _probe(address: str, what: str, config: MooncakeStoreConfig) -> None:
    """Fail fast on an unreachable peer: Mooncake's setup retries for ~90 s, holding the GIL."""
    host, _, port = address.rpartition(":")
    try:
        with anyio.fail_after(config.call_timeout_s):
            stream = await anyio.connect_tcp(host.strip("[]"), int(port))
    except (OSError, TimeoutError) as exc:
        key = "master" if what == "master" else "metadata_server"
        raise StoreError(
            f"cannot reach the Mooncake {what} at {address} ({exc or 'timed out'}): check that "
            f"mooncake_master runs there, that store.mooncake.{key} names the right address, "
            "and that no firewall blocks it"
        ) from exc
    await stream.aclose()


async def _setup_client(
    store_module: Any, config: MooncakeStoreConfig, endpoints: MasterEndpoints
) -> MooncakeClient:
    client = store_module.MooncakeDistributedStore()
    setup = _setup_call(client, config, endpoints)
    try:
        with anyio.fail_after(config.startup_timeout_s):
            rc = await anyio.to_thread.run_sync(setup, abandon_on_cancel=True)
    except TimeoutError as exc:
        raise StoreError(
            f"mooncake setup against master {endpoints.master_address} and metadata server "
            f"{endpoints.metadata_server} did not finish within {config.startup_timeout_s}s "
            "(store.mooncake.startup_timeout_s): check both are up and reachable"
        ) from exc
    if rc != OK:
        await anyio.to_thread.run_sync(client.close)
        raise StoreError(
            f"mooncake setup failed with code {rc} (master {endpoints.master_address}, "
            f"metadata server {endpoints.metadata_server}, protocol {config.protocol}, "
            f"segment {config.global_segment_bytes} bytes): check the master's and the "
            "metadata server's addresses, and store.mooncake.local_hostname"
        )
    return client  # type: ignore[no-any-return]


def _setup_call(client: Any, config: MooncakeStoreConfig, endpoints: MasterEndpoints) -> Any:
    def setup() -> int:
        rc: int = client.setup(
            local_hostname=config.local_hostname,
            metadata_server=endpoints.metadata_server,
            global_segment_size=config.global_segment_bytes,
            local_buffer_size=config.local_buffer_bytes,
            protocol=config.protocol,
            rdma_devices=config.device_name,
            master_server_addr=endpoints.master_address,
            tenant_id=config.tenant_id or "default",
        )
        return rc

    return setup
