"""What an operator's config file holds: every key an operator sets, grouped by the
decision it stands for.

- **Endpoint and security** (``server``, ``tenants``): where the sidecar listens, who may
  connect, and which key namespace each identity gets.
- **Store and capacity** (``store``): which store holds the blocks, how much memory it
  has, how values are written, where engines keep their KV, and what happens to saves
  when the sidecar is overloaded.
- **Observability** (``metrics``, ``events``, ``logging``).

A choice that spans several settings is one named mode (``store.format``,
``store.overload``); a file that sets keys that contradict each other
is refused with both keys named. The checks that concern one section alone (identities,
tenants, tcp endpoints) are the effective tree's, under the same paths. Everything else
the sidecar needs is derived from these and from the machine
(``pipeline.core.config.resolve``), or is a named constant of ``pipeline.core.config.schema``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pipeline.core.config.base import Positive, Section
from pipeline.core.config.schema import default_endpoint, own_identity

__all__ = [
    "EventsSection",
    "LoggingSection",
    "MetricsSection",
    "MooncakeSection",
    "OperatorConfig",
    "ServerSection",
    "StoreSection",
    "TenantSection",
]



class ServerSection(Section, frozen=True):
    endpoint: str = msgspec.field(default_factory=default_endpoint)
    """Where engines connect: ``ipc://PATH`` or ``tcp://HOST:PORT``. By default a socket
    in a directory only this user can enter: ``$XDG_RUNTIME_DIR/kvsidecar/sidecar.sock``,
    or ``/tmp/kvsidecar-$UID/sidecar.sock`` without ``XDG_RUNTIME_DIR``."""
    ipc_permissions: int = 0o600
    """File mode of an ipc:// socket (octal in YAML: ``0660`` lets the group connect)."""
    allow_insecure_tcp: bool = False
    """Allow tcp:// without CURVE authentication (any peer that reaches the port)."""
    curve_secret_key_file: str = ""
    """The sidecar's Z85 CURVE secret key (``kvsidecar keygen``); empty: CURVE off. Set
    together with ``curve_allowed_keys_file``."""
    curve_allowed_keys_file: str = ""
    """Engine public keys admitted when CURVE is on: Z85, one per line, ``#`` comments."""
    operators: tuple[str, ...] = msgspec.field(default_factory=lambda: (own_identity(),))
    """Identities that may see every tenant (``explain``, ``status``); default: the
    sidecar's own unix user."""
    max_peers: Positive = 128
    """Connections at once (engines, their schedulers, tools); one more is refused at its
    handshake."""
    drain_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """On SIGTERM, how long in-flight work may take before it is aborted."""


class TenantSection(Section, frozen=True):
    """One tenant: the identities that belong to it and the key prefix forced on every
    key its engines store or look up."""

    identities: tuple[str, ...]
    """``uid:<n>`` (an ipc:// peer's unix user), ``curve:<Z85 public key>`` or
    ``insecure`` (peers over plain tcp)."""
    key_prefix: str = ""
    """Default: the tenant's name."""


class MooncakeSection(Section, frozen=True):
    """Used only with ``store.backend: mooncake``; set with the embedded store, refused."""

    master: str = "embedded"
    """``embedded`` starts ``mooncake_master`` on loopback; else ``host:port`` of a
    cluster's master."""
    metadata_server: str = ""
    """Metadata server URL; empty with an embedded master: its HTTP metadata server."""
    local_hostname: str = "127.0.0.1"
    """Address other Mooncake clients reach this one's segment at."""
    rdma_devices: str = ""
    """RDMA devices for Mooncake's transfers (``mlx5_0,mlx5_1``); empty: TCP."""
    replica_num: Positive = 1
    """Copies of each value in the cluster."""
    preferred_segment: str = "local"
    """Where puts land while it has room, then wherever Mooncake places them: ``local``
    (this sidecar's own segment), a segment's name (``host:port``), or empty (Mooncake
    places every put)."""


class DiskSection(Section, frozen=True):
    """A disk tier under the embedded store: values written behind memory, read back
    checked, kept across restarts. Refused with Mooncake, which has its own."""

    path: str = ""
    """Its directory, created 0700 and owned by this sidecar alone; empty: no disk tier."""
    bytes: Annotated[int, msgspec.Meta(ge=64 * 1024 * 1024)] = 64 * 1024 * 1024 * 1024
    """The most it takes on disk (default 64 GiB)."""
    promote: Literal["on_hit", "never"] = "on_hit"
    """A value loaded from disk stays in memory (``on_hit``) or is only read through it
    (``never``)."""


StoreFormat = Literal["native", "vllm", "vllm_unverified"]
Overload = Literal["shed_saves", "shed_saves_never_wait", "backpressure"]


class StoreSection(Section, frozen=True):
    backend: Literal["embedded", "mooncake"] = "embedded"
    """``embedded``: in this process's memory. ``mooncake``: a Mooncake cluster, shared by
    every sidecar that joins it."""
    capacity_bytes: Positive | None = None
    """Memory this sidecar gives the store: the embedded store's arena, or the segment it
    contributes to Mooncake (at least 16 MiB). Default: 1 GiB embedded, 512 MiB for
    Mooncake."""
    format: StoreFormat = "native"
    """``native``: kvsidecar's values, each sealed with a checksum verified on load, in a
    namespace vLLM never reads. ``vllm``: keys and values byte-identical to vLLM's
    MooncakeStoreConnector, so both share one cluster; the checksum is kept beside each
    value and a value without one is not a hit. ``vllm_unverified``: the same, but a
    value without its checksum (as vLLM writes it) is loaded as it is."""
    engine_memory: Literal["cpu", "cuda"] = "cpu"
    """Where engines keep their KV: ``cpu`` (shared memory) or ``cuda`` (GPU memory shared
    by IPC handle, copied by CUDA streams). With ``cpu``, a GPU registration is refused."""
    overload: Overload = "shed_saves"
    """What happens to a save the sidecar has no room for. ``shed_saves``: a save past its
    engine's share, or one finding the save path full, is answered at once with every
    block ``skipped(overloaded)``, and loads and lookups never wait behind saves; a save
    that is taken waits for staging memory. ``shed_saves_never_wait``: the same, and a
    save finding staging memory exhausted is skipped too (``staging_full``) instead of
    waiting. ``backpressure``: nothing is shed; the sidecar stops reading requests until
    there is room, so every engine waits."""
    disk: DiskSection = DiskSection()
    mooncake: MooncakeSection = MooncakeSection()


class MetricsSection(Section, frozen=True):
    listen: str = ""
    """Serve Prometheus metrics at ``http://HOST:PORT/metrics``; empty: off."""

    def __post_init__(self) -> None:
        if self.listen:
            host, colon, port = self.listen.rpartition(":")
            if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")

    def host_port(self) -> tuple[str, int]:
        """``(host, port)``; port 0 when metrics are off."""
        if not self.listen:
            return "127.0.0.1", 0
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


class EventsSection(Section, frozen=True):
    """KV events for routers, wire-identical to vLLM's ``ZmqEventPublisher``."""

    endpoint: str = ""
    """The PUB socket the sidecar binds (``ipc://PATH``); empty: no events."""
    replay_endpoint: str = ""
    """The ROUTER answering replay requests for missed batches; empty: no replay. Needs
    ``endpoint``."""
    include_token_ids: bool = False
    """Send each stored block's token ids (prompt content) when the engine sent them."""
    allow_insecure: bool = False
    """Bind the event sockets on tcp://: anyone who can reach the port reads every block
    hash (a PUB socket cannot tell its subscribers apart)."""


class LoggingSection(Section, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """``info`` logs one line per finished request; ``warning`` only what went wrong."""


class OperatorConfig(Section, frozen=True):
    server: ServerSection = ServerSection()
    tenants: dict[str, TenantSection] = msgspec.field(default_factory=dict)
    """Identities to tenants, each with its own key namespace; empty: one tenant, which
    admits the operators (and CURVE's allowed keys, or plain tcp where allowed)."""
    store: StoreSection = StoreSection()
    metrics: MetricsSection = MetricsSection()
    events: EventsSection = EventsSection()
    logging: LoggingSection = LoggingSection()
