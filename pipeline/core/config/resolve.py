"""From the operator's config and the machine to the effective tree.

``resolve`` turns each operator key and named mode into the settings it stands for, and
sizes what depends on the host from ``Machine``. The result is a document in the shape of
``schema.Config``; tuning (old keys, a test config) is merged over it before it is decoded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline.core.config.operator import DiskSection, MooncakeSection, OperatorConfig
from pipeline.core.config.schema import Config, host_memory_bytes
from pipeline.core.errors import ConfigError

__all__ = ["Machine", "merge", "resolve", "resolved"]

MiB = 1024 * 1024
GiB = 1024 * MiB

OVERFLOWS = {
    "shed_saves": ("skip", "block"),
    "shed_saves_never_wait": ("skip", "skip"),
    "backpressure": ("block", "block"),
}
"""``store.overload`` to ``(stages.receive.overflow, stages.transfer.overflow)``."""

FORMATS = {
    "native": ("native", "required"),
    "vllm": ("vllm", "required"),
    "vllm_unverified": ("vllm", "if_present"),
}
"""``store.format`` to ``(store.value_format, store.verify)``."""

DEFAULT_CAPACITY = {"embedded": GiB, "mooncake": 512 * MiB}
MOONCAKE_MIN_SEGMENT = 16 * MiB


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged into it, mapping by mapping; neither is modified."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class Machine:
    """What the sidecar sizes itself by: the CPUs it may run on and the host's memory."""

    cpus: int
    memory_bytes: int

    @classmethod
    def detect(cls) -> Machine:
        return cls(cpus=len(os.sched_getaffinity(0)), memory_bytes=host_memory_bytes())

    @property
    def copy_threads(self) -> int:
        """Copy threads for saves and for loads each: a quarter of the CPUs, within
        [2, 8]. Two, so that one block's copy splits; eight, past which copies are bound
        by memory bandwidth, not by threads."""
        return min(8, max(2, self.cpus // 4))

    @property
    def staging_bytes(self) -> int:
        """The staging pool: the largest power of two at most a 16th of the host's
        memory, within [512 MiB, 4 GiB]. It is allocated at start and touched only where
        values pass through it (Mooncake without in-place moves, CUDA engines)."""
        share = max(1, self.memory_bytes // 16)
        return min(4 * GiB, max(512 * MiB, 1 << (share.bit_length() - 1)))


def disk_segment_bytes(budget: int) -> int:
    """A disk tier's segment size: the largest power of two at most an eighth of its
    budget, within [8 MiB, 256 MiB]. Segments are what the budget evicts whole, so the
    budget holds at least eight; past 256 MiB one eviction would drop too much at once."""
    share = max(1, budget // 8)
    return min(256 * MiB, max(8 * MiB, 1 << (share.bit_length() - 1)))


def disk_queue_bytes(capacity: int) -> int:
    """Values waiting for the disk, pinned in memory meanwhile: an eighth of the memory
    tier, at most 256 MiB, so that a disk that falls behind holds little of it."""
    return max(4096, min(256 * MiB, capacity // 8))


def _refuse_contradictions(config: OperatorConfig) -> None:
    store = config.store
    if store.backend != "mooncake":
        default = MooncakeSection()
        for item in msgspec.structs.fields(MooncakeSection):
            if getattr(store.mooncake, item.name) != getattr(default, item.name):
                raise ConfigError(
                    f"store.mooncake.{item.name} is set but store.backend is "
                    f"{store.backend!r}; set store.backend: mooncake, or drop it")
    if store.backend == "mooncake" and store.disk != DiskSection():
        raise ConfigError("store.disk is set but store.backend is 'mooncake'; Mooncake "
                          "keeps its own SSD offload: drop store.disk, or use the embedded "
                          "store")
    if (store.backend == "mooncake" and store.capacity_bytes is not None
            and store.capacity_bytes < MOONCAKE_MIN_SEGMENT):
        raise ConfigError(f"store.capacity_bytes is {store.capacity_bytes}, but Mooncake's "
                          f"segment is at least {MOONCAKE_MIN_SEGMENT} bytes (16 MiB)")
    if config.events.replay_endpoint and not config.events.endpoint:
        raise ConfigError("events.replay_endpoint is set but events.endpoint is not: "
                          "replay serves the batches the event socket published")


def resolve(config: OperatorConfig, machine: Machine) -> dict[str, Any]:
    """The effective tree's document for ``config`` on ``machine``: every field, its
    constant where no operator key or machine figure sets it. Refuses (``ConfigError``
    naming both keys) operator keys that contradict each other."""
    return merge(msgspec.to_builtins(Config()), resolved(config, machine))


def resolved(config: OperatorConfig, machine: Machine) -> dict[str, Any]:
    """The fields of the effective tree that operator keys and the machine set."""
    _refuse_contradictions(config)
    server, store, events = config.server, config.store, config.events
    receive, transfer = OVERFLOWS[store.overload]
    value_format, verify = FORMATS[store.format]
    capacity = store.capacity_bytes or DEFAULT_CAPACITY[store.backend]
    mooncake = store.mooncake
    host, port = config.metrics.host_port()
    return {
        "server": msgspec.to_builtins(server),
        "tenants": msgspec.to_builtins(config.tenants),
        "stages": {
            "receive": {"overflow": receive},
            "transfer": {"overflow": transfer, "device": store.engine_memory,
                         "threads": machine.copy_threads},
        },
        "staging": {"pool_bytes": machine.staging_bytes},
        "store": {
            "backend": store.backend,
            "value_format": value_format,
            "verify": verify,
            "embedded": {"capacity_bytes": capacity if store.backend == "embedded" else GiB},
            "disk": {"path": store.disk.path, "bytes": store.disk.bytes,
                     "promote": store.disk.promote,
                     "segment_bytes": disk_segment_bytes(store.disk.bytes),
                     "max_queued_bytes": disk_queue_bytes(capacity),
                     "flush_timeout_s": server.drain_timeout_s},
            "mooncake": {
                "master": mooncake.master,
                "metadata_server": mooncake.metadata_server,
                "local_hostname": mooncake.local_hostname,
                "protocol": "rdma" if mooncake.rdma_devices else "tcp",
                "device_name": mooncake.rdma_devices,
                "replica_num": mooncake.replica_num,
                "preferred_segment": mooncake.preferred_segment,
                "global_segment_bytes": (capacity if store.backend == "mooncake"
                                         else DEFAULT_CAPACITY["mooncake"]),
            },
        },
        "metrics": {"host": host, "port": port},
        "events": msgspec.to_builtins(events),
        "logging": msgspec.to_builtins(config.logging),
    }
