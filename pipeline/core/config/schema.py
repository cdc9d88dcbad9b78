"""The effective configuration: the frozen, typed tree the sidecar runs with.

An operator does not write this tree: ``pipeline.core.config.operator`` is what a config
file holds, and ``pipeline.core.config.resolve`` builds this tree from it and from the
machine. Every field here that no operator key sets is a named constant, whose default and
docstring say what it bounds; tests and benchmarks set them through a test-only config
(``kvsidecar serve --test-config``). Unknown keys are rejected and every error names the
path of the bad key (``$.stages.batching.max_blocks``). Environment variables are read
only in this package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from pipeline.core.config.base import Positive, PositiveFloat, Section
from pipeline.core.config.faults import FAULT_POINTS, FaultPointConfig, FaultsConfig
from pipeline.core.config.store import (
    BreakerConfig,
    DiskStoreConfig,
    EmbeddedStoreConfig,
    MooncakeStoreConfig,
    StoreConfig,
)

__all__ = [
    "FAULT_POINTS",
    "BatchingStageConfig",
    "BreakerConfig",
    "Config",
    "DiskStoreConfig",
    "EmbeddedStoreConfig",
    "EventsConfig",
    "ExplainConfig",
    "FaultPointConfig",
    "FaultsConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "MooncakeStoreConfig",
    "ReceiveStageConfig",
    "ServerConfig",
    "StageConfig",
    "StagesConfig",
    "StagingConfig",
    "StoreConfig",
    "TenantConfig",
    "TransferStageConfig",
    "check_identity",
    "default_endpoint",
    "host_memory_bytes",
    "own_identity",
    "runtime_dir",
]



def runtime_dir() -> Path:
    """The sidecar's private directory: ``$XDG_RUNTIME_DIR/kvsidecar``, else
    ``/tmp/kvsidecar-$UID`` (created mode 0700 and checked at start)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "kvsidecar"
    return Path(f"/tmp/kvsidecar-{os.getuid()}")


def default_endpoint() -> str:
    return f"ipc://{runtime_dir()}/sidecar.sock"


def own_identity() -> str:
    """The sidecar's own unix user as an identity: the default operator."""
    return f"uid:{os.getuid()}"


_IDENTITY_HELP = "'uid:<n>', 'curve:<Z85 public key>' or 'insecure'"


def check_identity(identity: str) -> None:
    """Raise ``ValueError`` unless ``identity`` is an identity a transport can prove."""
    kind, _, value = identity.partition(":")
    if identity == "insecure" or (kind == "uid" and value.isdigit()):
        return
    if kind == "curve" and len(value) == 40:
        return
    raise ValueError(f"identity {identity!r} is not one of {_IDENTITY_HELP}")


class ServerConfig(Section, frozen=True):
    endpoint: str = msgspec.field(default_factory=default_endpoint)
    rcvhwm: Positive = 1000
    """Messages queued per engine before ZMQ pushes back on it."""
    sndhwm: Positive = 1000
    max_frame_bytes: Positive = 16 * 1024 * 1024
    max_peers: Positive = 128
    """Connections at once (engines, their schedulers, tools); one more is refused at its
    handshake. What peers can queue is at most max_peers x rcvhwm frames."""
    ipc_permissions: int = 0o600
    allow_insecure_tcp: bool = False
    """Allow tcp:// (loopback too) without CURVE authentication."""
    curve_secret_key_file: str = ""
    """The sidecar's Z85 CURVE secret key (``kvsidecar keygen``); empty: CURVE off."""
    curve_allowed_keys_file: str = ""
    """Engine public keys admitted when CURVE is on: Z85, one per line, ``#`` comments."""
    operators: tuple[str, ...] = msgspec.field(default_factory=lambda: (own_identity(),))
    """Identities that may see every tenant (explain, status): the CLI's. Default: the
    sidecar's own unix user."""
    heartbeat_timeout_s: PositiveFloat = 30.0
    """An engine silent for this long is reaped and its mappings released."""
    drain_timeout_s: PositiveFloat = 10.0
    """On SIGTERM, how long in-flight work may take before it is aborted."""

    def __post_init__(self) -> None:
        if bool(self.curve_secret_key_file) != bool(self.curve_allowed_keys_file):
            raise ValueError(
                "curve_secret_key_file and curve_allowed_keys_file must be set together"
            )
        for identity in self.operators:
            check_identity(identity)


class TenantConfig(Section, frozen=True):
    """One tenant: the identities that belong to it and the key prefix forced on every
    key its engines store or look up."""

    identities: tuple[str, ...]
    key_prefix: str = ""
    """Default: the tenant's name."""

    def __post_init__(self) -> None:
        if not self.identities:
            raise ValueError("a tenant needs at least one identity")
        for identity in self.identities:
            check_identity(identity)
        if "@" in self.key_prefix:
            raise ValueError(f"key_prefix must contain no '@', got {self.key_prefix!r}")


class StageConfig(Section, frozen=True):
    inbox_size: Positive = 64
    """Bound of the stream feeding this stage."""
    workers: Positive = 1


class ReceiveStageConfig(Section, frozen=True):
    """The receive loop has no inbox of its own (``server.rcvhwm`` bounds the socket): it
    hands requests to each path's first stage, whose inbox bounds what is queued."""

    overflow: Literal["block", "skip"] = "skip"
    """A save arriving when its engine already has ``max_saves_per_engine`` in flight, or
    the save path's inbox is full: ``skip`` answers it at once, every block skipped(overloaded);
    ``block`` stops reading the socket until there is room (backpressure on everyone)."""
    max_saves_per_engine: Positive = 32
    """Saves of one engine in the pipeline at once: one engine's flood cannot fill it."""


class BatchingStageConfig(StageConfig, frozen=True):
    max_blocks: Positive = 64
    """Blocks per batch (also capped by what fits in one staging slot)."""
    deadline_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """How long a partial batch may wait for more blocks."""


class TransferStageConfig(StageConfig, frozen=True):
    threads: Positive = 2
    """Threads a batch's copy is split across (its layers, or its rows for checksums).
    Saves and loads each have this many, so a load never waits behind a save's copy.
    Values moved in place are not copied: their checksums are shared by the store's
    thread and this many less one helper threads."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Who copies: CPU threads, or CUDA streams for engines whose KV is in GPU memory
    (shared by IPC handle; CPU tensors are still copied by threads). With ``cpu`` a
    registration of GPU tensors is refused."""
    cuda_streams: Positive = 2
    """Copy streams per GPU, for saves and loads each (``device: cuda``)."""
    overflow: Literal["block", "skip"] = "block"
    """A save finding staging exhausted: wait for a slot, or skip it (staging_full)."""
    yield_to_loads_ms: Annotated[float, msgspec.Meta(ge=0)] = 20.0
    """A save batch waits up to this long while loads are in flight before copying, so
    that loads (on the engine's critical path) get the cores and memory bandwidth first;
    0: never wait."""
    save_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    """How much lower the CPU priority of the saves' copy threads is (added to their nice
    value, Linux): on cores shared with engines, loads and the engines' own work come
    first, and saves still use every core left idle. 0: the same as loads."""


class StagesConfig(Section, frozen=True):
    """Each stage's inbox and workers. A batch stage's inbox holds whole batches (each up
    to a staging slot): a few are enough to keep its workers busy."""

    receive: ReceiveStageConfig = ReceiveStageConfig()
    group_filter: StageConfig = StageConfig()
    hashing: StageConfig = StageConfig()
    dedup: StageConfig = StageConfig(workers=2)
    batching: BatchingStageConfig = BatchingStageConfig()
    transfer: TransferStageConfig = TransferStageConfig(inbox_size=64, workers=2)
    commit: StageConfig = StageConfig(inbox_size=8, workers=2)
    fetch: StageConfig = StageConfig(inbox_size=8, workers=2)
    scatter: StageConfig = StageConfig(inbox_size=64, workers=2)
    lookup: StageConfig = StageConfig(workers=4)


class StagingConfig(Section, frozen=True):
    pool_bytes: Positive = 1024 * 1024 * 1024
    """Fixed staging memory for saves and loads; exhausted means backpressure."""
    slot_bytes: Positive = 64 * 1024 * 1024
    """One batch of blocks occupies one slot, so this also caps a batch's bytes."""
    load_slots: Positive = 4
    """Slots only loads may use, so a flood of saves never delays a load."""

    def __post_init__(self) -> None:
        # Caught here, the error names $.staging; the pool would only fail at start-up.
        slots = self.pool_bytes // self.slot_bytes if self.slot_bytes > 0 else 0
        if not 1 <= self.load_slots < slots:
            raise ValueError(
                f"pool_bytes // slot_bytes gives {slots} slot(s); load_slots must be in "
                f"[1, {slots - 1}] so saves keep at least one, got {self.load_slots}"
            )


class EventsConfig(Section, frozen=True):
    """KV events for routers, wire-identical to vLLM's ``ZmqEventPublisher``."""

    endpoint: str = ""
    """The PUB socket the sidecar binds (e.g. tcp://127.0.0.1:5557); empty: no events."""
    replay_endpoint: str = ""
    """The ROUTER answering replay requests for missed batches; empty: no replay."""
    topic: str = "kvsidecar"
    include_token_ids: bool = False
    """Send each stored block's token ids (prompt content) when the engine sent them."""
    replay_buffer: Annotated[int, msgspec.Meta(ge=1)] = 10000
    """Batches kept for replay."""
    hash_format: Literal["int", "bytes"] = "int"
    """int: the low 64 bits, big-endian, as vLLM sends by default; bytes: the digest."""
    medium: str = "cpu"
    """The tier named in every event (vLLM's Mooncake store connector says "cpu")."""
    max_pending: Annotated[int, msgspec.Meta(ge=1)] = 100000
    """Events waiting to be published; past it events are dropped (and counted)."""
    allow_insecure: bool = False
    """Bind the event sockets on tcp://. They are the operator's: a PUB socket cannot
    tell its subscribers apart, and the replay socket hands its whole buffer to whoever
    asks, so on tcp anyone who can reach the port reads every block hash."""

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            if getattr(self, name).startswith("tcp://") and not self.allow_insecure:
                raise ValueError(
                    f"{name} {getattr(self, name)!r} is tcp: every local user (and beyond "
                    "loopback, every host) could read every event; use ipc://, or set "
                    "events.allow_insecure: true")


class MetricsConfig(Section, frozen=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Serve Prometheus metrics at http://host:port/metrics (0: off)."""


class ExplainConfig(Section, frozen=True):
    max_blocks: Annotated[int, msgspec.Meta(ge=0)] = 16384
    """Blocks whose fate is remembered to explain misses (0: none; ~1 KiB each)."""


class LoggingConfig(Section, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    """``auto``: JSON when stderr is not a terminal."""
    requests: bool = True
    """One ``request.done`` line per completed request, at info level."""


def host_memory_bytes() -> int:
    """The host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class LimitsConfig(Section, frozen=True):
    """What one peer may cost the sidecar. Every size a peer sends is bounded by the wire
    schema; these caps are tighter, so that no legal request is huge. A request or
    registration past one is refused with an error naming the limit."""

    max_engines: Positive = 64
    """Registered engine sessions at once (a scheduler and each worker count one each)."""
    max_block_tokens: Annotated[int, msgspec.Meta(gt=0, le=1 << 16)] = 8192
    """Tokens per block of any group, and so per hash block."""
    max_request_tokens: Annotated[int, msgspec.Meta(gt=0, le=1 << 22)] = 1 << 20
    """Tokens of one lookup, save, load or explanation."""
    max_request_blocks: Annotated[int, msgspec.Meta(gt=0, le=1 << 22)] = 1 << 16
    """Hash blocks of one request (its tokens over the hash block size): what bounds the
    blocks it can name in every group, and so the work it costs the sidecar."""
    engine_mapped_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Memory one engine may have mapped into the sidecar (0: the host's memory)."""
    total_mapped_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Memory all engines together may have mapped (0: twice the host's memory)."""

    def engine_mapped(self) -> int:
        return self.engine_mapped_bytes or host_memory_bytes()

    def total_mapped(self) -> int:
        return self.total_mapped_bytes or 2 * host_memory_bytes()


class Config(Section, frozen=True):
    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    stages: StagesConfig = StagesConfig()
    staging: StagingConfig = StagingConfig()
    store: StoreConfig = StoreConfig()
    faults: FaultsConfig = FaultsConfig()
    events: EventsConfig = EventsConfig()
    metrics: MetricsConfig = MetricsConfig()
    explain: ExplainConfig = ExplainConfig()
    logging: LoggingConfig = LoggingConfig()
    tenants: dict[str, TenantConfig] = msgspec.field(default_factory=dict)
    """Identities to tenants, each with its own key namespace; empty: one tenant, which
    admits the operators (and CURVE's allowed keys, or plain tcp where allowed)."""

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        prefixes: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            if not name or "@" in name:
                raise ValueError(f"tenant name {name!r} must be non-empty and contain no '@'")
            prefix = tenant.key_prefix or name
            if prefix in prefixes:
                raise ValueError(f"tenants {prefixes[prefix]!r} and {name!r} share the key "
                                 f"prefix {prefix!r}")
            prefixes[prefix] = name
            for identity in tenant.identities:
                if identity in seen:
                    raise ValueError(f"identity {identity!r} is in tenants {seen[identity]!r} "
                                     f"and {name!r}")
                seen[identity] = name
