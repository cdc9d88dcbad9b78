"""The sidecar's configuration.

An operator writes ``OperatorConfig`` (``operator``): at most 30 keys, grouped by the
decision they stand for. ``read_config`` migrates an old file (``migrate``), decodes the
operator's keys strictly, resolves them and the machine into the effective tree
(``resolve``), merges tuning over it (old keys, then a test config) and decodes the result
as ``Config`` (``schema``), the frozen tree the sidecar runs with. Every error is a
``ConfigError`` naming the file and the key's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pipeline.core.config.migrate import Migrated, migrate, operator_paths
from pipeline.core.config.operator import OperatorConfig
from pipeline.core.config.resolve import Machine, merge, resolve
from pipeline.core.config.schema import *  # noqa: F403
from pipeline.core.config.schema import Config
from pipeline.core.config.schema import __all__ as _schema_all
from pipeline.core.errors import ConfigError

__all__ = [
    *_schema_all,
    "ConfigError",
    "LoadedConfig",
    "Machine",
    "OperatorConfig",
    "load_config",
    "merge",
    "operator_paths",
    "read_config",
]


@dataclass(frozen=True)
class LoadedConfig:
    config: Config
    """The effective tree."""
    operator: OperatorConfig
    """The operator's keys, after migration."""
    written: dict[str, Any] = field(default_factory=dict)
    """The operator's document as migrated: the keys the file set."""
    notes: tuple[str, ...] = ()
    """What the file should change (old keys), for the log and ``kvsidecar config``."""
    renamed: Mapping[str, str] = field(default_factory=dict)
    """Operator key to the old key(s) it was migrated from."""
    tuning: dict[str, Any] = field(default_factory=dict)
    """What old keys and the test config set in the effective tree."""
    machine: Machine = field(default_factory=Machine.detect)
    """The machine it was resolved for."""


def _read(path: str | Path) -> Any:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        document = msgspec.yaml.decode(raw) if raw.strip() else None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return {} if document is None else document  # empty, or comments only


def _room_for_slots(effective: dict[str, Any], tuning: Mapping[str, Any]) -> dict[str, Any]:
    """Where tuning sets the staging slots but not the pool, a pool the machine sized too
    small for them grows to the smallest that leaves saves a slot beside the loads'."""
    staging = effective.get("staging")
    set_here = tuning.get("staging")
    if not (isinstance(staging, dict) and isinstance(set_here, dict)) or (
            "pool_bytes" in set_here):
        return effective
    slot, load_slots = staging.get("slot_bytes"), staging.get("load_slots")
    if not (isinstance(slot, int) and isinstance(load_slots, int) and slot > 0):
        return effective  # refused with its path when decoded
    needed = (load_slots + 1) * slot
    if staging.get("pool_bytes", 0) < needed:
        return merge(effective, {"staging": {"pool_bytes": needed}})
    return effective


def read_config(
    path: str | Path | None = None,
    *,
    endpoint: str | None = None,
    test_config: str | Path | None = None,
    machine: Machine | None = None,
) -> LoadedConfig:
    """Load an operator's YAML (the defaults when ``path`` is None) on ``machine`` (this
    one by default). ``endpoint`` overrides the file's; ``test_config`` is a YAML in the
    effective tree's shape (fault points, constants), merged last."""
    machine = machine or Machine.detect()
    document = _read(path) if path is not None else {}
    where = str(path) if path is not None else "config"
    try:
        migrated: Migrated = migrate(document)
        operator = msgspec.convert(migrated.operator, OperatorConfig)
        tuning = migrated.tuning
        if test_config is not None:
            where = f"{where} + {test_config}"
            overlay = _read(test_config)
            if not isinstance(overlay, dict):
                raise ConfigError(f"a test config is a mapping, got {type(overlay).__name__}")
            tuning = merge(tuning, overlay)
        effective = _room_for_slots(merge(resolve(operator, machine), tuning), tuning)
        config = msgspec.convert(effective, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if endpoint is not None:
        config = msgspec.structs.replace(
            config, server=msgspec.structs.replace(config.server, endpoint=endpoint)
        )
    written = migrated.operator if isinstance(migrated.operator, dict) else {}
    return LoadedConfig(config=config, operator=operator, written=written,
                        notes=tuple(migrated.notes), renamed=migrated.renamed,
                        tuning=tuning, machine=machine)


def load_config(
    path: str | Path | None = None,
    *,
    endpoint: str | None = None,
    test_config: str | Path | None = None,
) -> Config:
    """The effective tree of ``read_config``."""
    return read_config(path, endpoint=endpoint, test_config=test_config).config
