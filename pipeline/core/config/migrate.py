"""Config files written for the old, long config keep loading.

``migrate`` turns a config document as read into the operator's document and a tuning
document (the effective tree's shape):

- an old key whose decision is now an operator key is rewritten to it, with a note
  (``stages.receive.overflow`` and ``stages.transfer.overflow`` become ``store.overload``);
- an old key that is no longer an operator setting is honoured, in the tuning document,
  with one note listing them all;
- fault injection in an operator's file, and old keys that contradict each other or the
  new key they migrate to, are refused naming the keys.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.core.config.operator import OperatorConfig
from pipeline.core.config.resolve import FORMATS, OVERFLOWS, merge
from pipeline.core.errors import ConfigError

__all__ = ["RENAMED", "Migrated", "has_path", "migrate", "operator_paths",
           "split_operator_keys"]

OVERLOAD_MODES = {overflows: mode for mode, overflows in OVERFLOWS.items()}
"""``(stages.receive.overflow, stages.transfer.overflow)`` to ``store.overload``: the
modes' table read backwards."""

FORMAT_OF = {
    **{settings: name for name, settings in FORMATS.items()},
    ("native", "if_present"): "native",  # native values carry their checksum inside
}
"""``(store.value_format, store.verify)`` to ``store.format``."""


RENAMED = {
    "stages.receive.overflow": "`store.overload`: skip with `stages.transfer.overflow: block` "
                               "is `shed_saves`, block with block is `backpressure`",
    "stages.transfer.overflow": "`store.overload`: skip with `stages.receive.overflow: skip` is "
                                "`shed_saves_never_wait`; block at the door with skip here is "
                                "refused",
    "store.value_format, store.verify": "`store.format`: `native`, `vllm` (verify: required) "
                                        "or `vllm_unverified` (verify: if_present)",
    "stages.transfer.device": "`store.engine_memory`",
    "store.embedded.capacity_bytes": "`store.capacity_bytes` (embedded store)",
    "store.mooncake.global_segment_bytes": "`store.capacity_bytes` (Mooncake)",
    "store.mooncake.protocol, store.mooncake.device_name": "`store.mooncake.rdma_devices` "
                                                          "(empty: tcp)",
    "metrics.host, metrics.port": "`metrics.listen: HOST:PORT` (empty: off)",
    "stages.completion": "dropped: a request is answered by the stage that finishes it",
    "faults": "refused when it names fault points (tests pass them to `kvsidecar serve "
              "--test-config`); a section naming none is dropped",
}
"""Old keys and what replaced them, for the upgrade notes."""


@dataclass
class Migrated:
    operator: dict[str, Any]
    """The operator's document: only keys of ``OperatorConfig``."""
    tuning: dict[str, Any]
    """Old keys honoured as they are, in the effective tree's shape."""
    notes: list[str] = field(default_factory=list)
    """One line per thing the file should change, for the log and ``kvsidecar config``."""
    renamed: dict[str, str] = field(default_factory=dict)
    """New key to the old key(s) it was migrated from."""


def operator_paths(struct: type = OperatorConfig, prefix: str = "") -> Iterator[str]:
    """Every operator leaf's dotted path; a mapping of named entries (tenants) is one."""
    for item in msgspec.structs.fields(struct):
        if isinstance(item.type, type) and issubclass(item.type, msgspec.Struct):
            yield from operator_paths(item.type, f"{prefix}{item.name}.")
        else:
            yield f"{prefix}{item.name}"


_OPERATOR = frozenset(operator_paths())


def _pop(document: dict[str, Any], path: str) -> tuple[bool, Any]:
    *parents, name = path.split(".")
    node: Any = document
    chain = []
    for part in parents:
        if not isinstance(node, dict) or not isinstance(node.get(part), dict):
            return False, None
        chain.append((node, part))
        node = node[part]
    if name not in node:
        return False, None
    value = node.pop(name)
    for parent, part in reversed(chain):  # drop the sections the pop left empty
        if parent[part]:
            break
        del parent[part]
    return True, value


def has_path(document: Any, path: str) -> bool:
    """Whether the nested mappings of ``document`` hold the dotted ``path``."""
    node: Any = document
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _put(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    node = document
    for part in parents:
        node = node.setdefault(part, {})
    node[name] = value


def _leaves(document: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf's dotted path and value; an empty section has none, and a mapping of
    named entries (tenants) is one."""
    for key, value in document.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in _OPERATOR:
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


def split_operator_keys(
    document: Mapping[str, Any], prefix: str = "",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``document``'s operator keys, as they are, and the rest, in the effective tree's
    shape (an empty section goes to neither; named entries keep their names, dots and
    all)."""
    operator: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in document.items():
        path = f"{prefix}{key}"
        if path in _OPERATOR:
            operator[key] = value
        elif isinstance(value, Mapping):
            inner_operator, inner_rest = split_operator_keys(value, f"{path}.")
            if inner_operator:
                operator[key] = inner_operator
            if inner_rest:
                rest[key] = inner_rest
        else:
            rest[key] = value
    return operator, rest


def _refuse_dotted_keys(document: Any, path: str = "$") -> None:
    """A key is one name: ``a.b: 1`` is not ``a: {b: 1}``. Named entries (tenants, fault
    points) may hold dots."""
    if not isinstance(document, dict):
        return
    for key, value in document.items():
        if isinstance(key, str) and "." in key:
            raise ConfigError(f"Object contains unknown field `{key}` - at `{path}`")
        if f"{path}.{key}" not in ("$.tenants", "$.faults"):
            _refuse_dotted_keys(value, f"{path}.{key}")


def _choice(path: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"Expected one of {allowed}, got {value!r} - at `$.{path}`")
    return str(value)


class _Migration:
    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.result = Migrated(operator={}, tuning={})

    def rename(self, new: str, old: list[str], value: Any) -> None:
        if has_path(self.document, new):
            raise ConfigError(f"{' and '.join(old)} and {new} both set the same thing; "
                              f"keep {new} alone")
        _put(self.result.operator, new, value)
        self.result.renamed[new] = " + ".join(old)
        self.result.notes.append(
            f"{' and '.join(old)}: renamed; write {new}: {json.dumps(value)}")

    def take(self, *paths: str) -> dict[str, Any]:
        """The old keys of ``paths`` the file sets, taken out of it, with their values."""
        taken = {path: _pop(self.document, path) for path in paths}
        return {path: value for path, (found, value) in taken.items() if found}

    def overload(self) -> None:
        old = self.take("stages.receive.overflow", "stages.transfer.overflow")
        if not old:
            return
        receive = _choice("stages.receive.overflow",
                          old.get("stages.receive.overflow", "skip"), ("block", "skip"))
        transfer = _choice("stages.transfer.overflow",
                           old.get("stages.transfer.overflow", "block"), ("block", "skip"))
        mode = OVERLOAD_MODES.get((receive, transfer))
        if mode is None:
            raise ConfigError(
                "stages.receive.overflow: block and stages.transfer.overflow: skip contradict "
                "each other (a save that waited at the door for room would then be dropped "
                "for want of staging); choose one store.overload mode")
        self.rename("store.overload", list(old), mode)

    def store_format(self) -> None:
        old = self.take("store.value_format", "store.verify")
        if not old:
            return
        value_format = _choice("store.value_format", old.get("store.value_format", "native"),
                               ("native", "vllm"))
        verify = _choice("store.verify", old.get("store.verify", "required"),
                         ("required", "if_present"))
        if value_format == "native" and verify == "if_present":
            self.result.notes.append("store.verify: has no effect on native values; dropped")
        self.rename("store.format", list(old), FORMAT_OF[value_format, verify])

    def capacity(self) -> None:
        store = self.document.get("store")
        backend = store.get("backend", "embedded") if isinstance(store, dict) else "embedded"
        active = ("store.mooncake.global_segment_bytes" if backend == "mooncake"
                  else "store.embedded.capacity_bytes")
        found, value = _pop(self.document, active)
        if found:
            self.rename("store.capacity_bytes", [active], value)

    def rdma(self) -> None:
        old = self.take("store.mooncake.protocol", "store.mooncake.device_name")
        if not old:
            return
        protocol = _choice("store.mooncake.protocol", old.get("store.mooncake.protocol", "tcp"),
                           ("tcp", "rdma"))
        devices = old.get("store.mooncake.device_name")
        if protocol == "rdma" and not devices:
            raise ConfigError("store.mooncake.protocol: rdma needs store.mooncake.device_name; "
                              "write store.mooncake.rdma_devices: <devices> instead")
        if protocol == "tcp" and devices:
            raise ConfigError("store.mooncake.device_name is set but store.mooncake.protocol "
                              "is tcp; write store.mooncake.rdma_devices for RDMA, or drop it")
        self.rename("store.mooncake.rdma_devices", list(old), devices or "")

    def metrics(self) -> None:
        old = self.take("metrics.host", "metrics.port")
        if not old:
            return
        host, port = old.get("metrics.host"), old.get("metrics.port", 0)
        if isinstance(port, bool) or not (isinstance(port, int) and 0 <= port <= 65535):
            raise ConfigError(f"Expected a port in [0, 65535], got {port!r} - at `$.metrics.port`")
        self.rename("metrics.listen", list(old), f"{host or '127.0.0.1'}:{port}" if port else "")

    def rest(self) -> None:
        operator, self.result.tuning = split_operator_keys(self.document)
        self.result.operator = merge(self.result.operator, operator)
        moved = [path for path, _ in _leaves(self.result.tuning)]
        if moved:
            self.result.notes.append(
                f"no longer operator settings, honoured for now: {', '.join(moved)}. Each "
                "is derived from the machine or a named constant (kvsidecar config shows "
                "the values); remove them")

    def run(self) -> Migrated:
        _refuse_dotted_keys(self.document)
        faults = self.document.pop("faults", None)
        idle = isinstance(faults, dict) and set(faults) <= {"seed", "points"} and not (
            faults.get("points"))
        if faults is not None and not idle:
            raise ConfigError("faults: fault injection is for tests only; pass it in a file "
                              "given to kvsidecar serve --test-config")
        if faults is not None:
            self.result.notes.append("faults: names no fault point; dropped")
        found, _ = _pop(self.document, "stages.completion")
        if found:
            self.result.notes.append("stages.completion: no such stage any more (a request "
                                     "is answered where it finishes); dropped")
        self.overload()
        self.store_format()
        found, device = _pop(self.document, "stages.transfer.device")
        if found:
            self.rename("store.engine_memory", ["stages.transfer.device"], device)
        self.capacity()
        self.rdma()
        self.metrics()
        self.rest()
        return self.result


def migrate(document: Any) -> Migrated:
    """Split a config document as read (not modified) into the operator's document and
    the old keys honoured as tuning; raise ``ConfigError`` for what cannot be migrated."""
    if not isinstance(document, dict):
        return Migrated(operator=document, tuning={})
    return _Migration(copy.deepcopy(document)).run()
