"""The store's part of the effective tree: which store, how values are written, and the
constants of the embedded store, Mooncake and the circuit breaker around them."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pipeline.core.config.base import Positive, PositiveFloat, Section

__all__ = [
    "BreakerConfig",
    "DiskStoreConfig",
    "EmbeddedStoreConfig",
    "MooncakeStoreConfig",
    "StoreConfig",
]



class EmbeddedStoreConfig(Section, frozen=True):
    capacity_bytes: Positive = 1024 * 1024 * 1024
    """Byte budget of the preallocated arena; least recently used blocks are evicted."""


MiB = 1 << 20


class DiskStoreConfig(Section, frozen=True):
    """The disk tier under the embedded store (``pipeline.backends.stores.disk``)."""

    path: str = ""
    """Its directory, owned by this sidecar alone; empty: no disk tier."""
    bytes: Annotated[int, msgspec.Meta(ge=64 * MiB)] = 64 * 1024 * MiB
    """The most its segment files take on disk."""
    promote: Literal["on_hit", "never"] = "on_hit"
    """A value loaded from disk stays in memory (``on_hit``), or is read through memory
    and not kept there (``never``)."""
    segment_bytes: Annotated[int, msgspec.Meta(ge=4 * MiB, multiple_of=4096)] = 256 * MiB
    """Each segment file's size: the unit of allocation and of eviction."""
    batch_bytes: Annotated[int, msgspec.Meta(ge=4096, multiple_of=4096)] = 8 * MiB
    """The most one write takes; a record longer than it is not written."""
    max_queued_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 128 * MiB
    """Bytes of values queued to be written, each held in memory meanwhile; a value past
    it waits unpinned for room, and is skipped if memory evicts it first."""
    writers: Positive = 2
    """Batches written at once."""
    readers: Positive = 4
    """Reads at once, on threads apart from the writers'."""
    flush_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    """On a graceful stop, how long values still only in memory may take to be written."""

    def __post_init__(self) -> None:
        if self.bytes < 2 * self.segment_bytes:
            raise ValueError(f"bytes ({self.bytes}) must hold two segments of segment_bytes "
                             f"({self.segment_bytes}): the budget drops one whole at a time")
        if self.batch_bytes > self.segment_bytes:
            raise ValueError(f"batch_bytes ({self.batch_bytes}) must fit a segment "
                             f"(segment_bytes {self.segment_bytes})")


class MooncakeStoreConfig(Section, frozen=True):
    master: str = "embedded"
    """``embedded`` starts ``mooncake_master`` on loopback; else ``host:port`` of a cluster."""
    metadata_server: str = ""
    """Metadata server URL; empty with an embedded master means its HTTP metadata server."""
    local_hostname: str = "127.0.0.1"
    """Address other Mooncake clients reach this one's segment at."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    """RDMA devices (``mlx5_0,mlx5_1``); empty with ``tcp``."""
    global_segment_bytes: Annotated[int, msgspec.Meta(ge=16 * 1024 * 1024)] = 512 * 1024 * 1024
    """Memory this sidecar contributes to the cluster (Mooncake's minimum is 16 MiB)."""
    local_buffer_bytes: Annotated[int, msgspec.Meta(ge=0)] = 128 * 1024 * 1024
    replica_num: Positive = 1
    preferred_segment: str = "local"
    """Where puts land while it has room, then wherever Mooncake places them: ``local``
    (this sidecar's own segment: a memory copy, no network), a segment's name
    (``host:port``), or empty (Mooncake places every put)."""
    tenant_id: str = ""
    """Mooncake tenant namespace; empty means Mooncake's ``default``."""
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """RPC port of an embedded master (0: pick a free one)."""
    metadata_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """HTTP metadata port of an embedded master (0: pick a free one)."""
    master_binary: str = "mooncake_master"
    master_log: str = ""
    """File the embedded master's output is appended to; empty: a temporary file."""
    kv_lease_ttl_ms: Positive = 1000
    """Embedded master: how long a read or write lease protects an object from removal
    (only objects whose lease has ended can be evicted); also the lease a load read from
    this sidecar's own segment counts on (``read_here``), no longer than a cluster
    master's."""
    eviction_high_watermark: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    """Embedded master: segment usage ratio above which objects are evicted."""
    eviction_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.1
    """Embedded master: share of objects evicted each time usage crosses the watermark."""
    startup_timeout_s: PositiveFloat = 20.0
    call_timeout_s: PositiveFloat = 10.0
    """A Mooncake call that takes longer is abandoned: its staging slot is withheld and
    the store refuses calls until it returns (the client gives up after 30 s)."""
    close_timeout_s: PositiveFloat = 5.0
    """How long close waits for in-flight calls; past it the client is left, not closed."""
    max_concurrent_calls: Positive = 4
    in_place: bool = True
    """Values move straight between the engine's KV memory (registered with Mooncake
    while mapped) and the store, with no staging copy: native values of CPU engines.
    Otherwise, and always for vllm values or a CUDA sidecar, they pass through staging."""
    read_here: bool = True
    """With ``in_place``: a load of values that lie in this sidecar's own segment copies
    them from there into the engine's blocks itself, checking each as it goes (one pass
    over the bytes, no transfer by Mooncake). Needs an HTTP metadata server, which says
    where the segment lies; otherwise loads move through Mooncake's get."""


class BreakerConfig(Section, frozen=True):
    call_timeout_s: PositiveFloat = 10.0
    """A store call taking longer counts as a failure."""
    failure_threshold: Positive = 3
    """Consecutive failures that open the circuit (then calls fail at once)."""
    reset_after_s: PositiveFloat = 2.0
    """How long an open circuit waits before letting one probing call through."""


class StoreConfig(Section, frozen=True):
    backend: Literal["embedded", "mooncake"] = "embedded"
    value_format: Literal["native", "vllm"] = "native"
    """native: kvsidecar's values, checksum inside, in a namespace vLLM never reads.
    vllm: values and keys byte-identical to vLLM's MooncakeStoreConnector, so both share
    one cluster; the checksum is kept beside each value (key + "@xxh3")."""
    checksum: bool = True
    """Seal every stored block with an xxh3 checksum and verify it on load; a mismatch
    fails the block. Off: values are the raw pages."""
    verify: Literal["required", "if_present"] = "required"
    """A vllm-format value without its checksum (as vLLM writes it): required: not a hit,
    never loaded; if_present: loaded as it is."""
    breaker: BreakerConfig = BreakerConfig()
    embedded: EmbeddedStoreConfig = EmbeddedStoreConfig()
    disk: DiskStoreConfig = DiskStoreConfig()
    mooncake: MooncakeStoreConfig = MooncakeStoreConfig()
