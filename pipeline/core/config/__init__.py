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


def _read(path: str | Path) -> Any:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        return msgspec.yaml.decode(raw) if raw.strip() else {}
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


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
            tuning = merge(tuning, _read(test_config) or {})
            where = f"{where} + {test_config}"
        effective = merge(resolve(operator, machine), tuning)
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
                        tuning=tuning)


def load_config(
    path: str | Path | None = None,
    *,
    endpoint: str | None = None,
    test_config: str | Path | None = None,
) -> Config:
    """The effective tree of ``read_config``."""
    return read_config(path, endpoint=endpoint, test_config=test_config).config
