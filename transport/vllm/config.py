"""The connector's settings: vLLM's ``kv_connector_extra_config``, typed and checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from pipeline.core.errors import ConfigError
from transport.server import load_key_pair, load_public_key

__all__ = ["ConnectorConfig"]

Positive = Annotated[float, msgspec.Meta(gt=0)]


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    endpoint: str
    """The sidecar's endpoint (``ipc://...`` or ``tcp://host:port``); the one required key."""
    timeout_s: Positive = 30.0
    """How long a save or a load may take before the engine gives up on it (the blocks
    are then recomputed, or released)."""
    lookup_timeout_s: Positive = 1.0
    """How long a lookup may take; a slower one is a miss."""
    lookup_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    """How long the scheduler waits for a lookup before it defers the request to a later
    step (vLLM asks again); the scheduler itself never waits longer."""
    lookup_spin_ms: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """How long the connector's client polls for a lookup's reply before it sleeps on
    the socket (``EngineClient.connect``'s ``lookup_spin_s``; 0: never poll)."""
    connect_timeout_s: Positive = 10.0
    retry_after_s: Positive = 5.0
    """After the sidecar could not be reached, requests skip it for this long."""
    heartbeat_interval_s: Positive = 5.0
    """How often the worker's connection says it is alive while idle. The scheduler's,
    lookups only, sends none: the sidecar may reap it, and its next lookup registers it
    again."""
    cache_prefix: str = ""
    """A namespace of this deployment's keys (tenants apart, or a model revision)."""
    store_tp_size: Annotated[int, msgspec.Meta(gt=0)] | None = None
    """As vLLM's MooncakeStoreConnector takes it: its keys then carry vLLM's
    ``store_namespace`` (sidecar ``store.format: vllm``)."""
    pinned_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.25
    """At most this share of the engine's KV blocks is held out of vLLM's free pool for
    saves the sidecar has not answered; past it a save is skipped (a cache fill lost),
    so a stalled sidecar costs the engine a bounded share of its blocks."""
    on_refused_layout: Literal["fail", "continue"] = "fail"
    """A sidecar that refuses this engine's layout or tensors (a group it cannot serve):
    ``fail`` stops the engine at start-up with the sidecar's reason; ``continue`` runs
    it without the sidecar, logged as an error. A sidecar that is not up yet never stops
    the engine; one that comes up later and refuses is logged (``vllm.sidecar.refused``)
    and not asked again."""
    min_load_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Load policy: a hit of fewer tokens than this (beyond the engine's own prefix
    cache) is recomputed instead of loaded."""
    curve_server_key_file: str | None = None
    """The sidecar's public key (``kvsidecar keygen``'s ``.key.pub``), for CURVE."""
    curve_key_file: str | None = None
    """This engine's key pair file (``kvsidecar keygen``'s ``.key``), for CURVE."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        try:
            return msgspec.convert(dict(extra or {}), cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from exc

    def curve(self) -> dict[str, Any]:
        """``EngineClient.connect``'s CURVE arguments (none unless both files are set)."""
        if (self.curve_server_key_file is None) != (self.curve_key_file is None):
            raise ConfigError(
                "kv_connector_extra_config: curve_server_key_file and curve_key_file "
                "go together"
            )
        if self.curve_server_key_file is None or self.curve_key_file is None:
            return {}
        return {"curve_server_key": load_public_key(self.curve_server_key_file),
                "curve_key_pair": load_key_pair(self.curve_key_file)}
