"""``kvsidecar config``: the effective config of a file on this machine.

It shows each operator key with where its value came from (the file, an old key it was
migrated from, or the default), what the sidecar derives from them and from the machine
at start-up, and with ``--all`` every constant of the effective tree. ``--reference``
prints the configuration reference (``docs/configuration.md``) from the typed config.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Iterator
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from pipeline.app.backends import moves_in_place
from pipeline.backends.cpu_copy import INLINE_BYTES, LOAD_INLINE_BYTES, LOAD_STREAM_BYTES
from pipeline.core.config import Config, LoadedConfig, Machine, OperatorConfig, read_config
from pipeline.core.config.migrate import RENAMED, has_path
from pipeline.core.config.operator import TenantSection
from pipeline.core.config.resolve import resolved
from pipeline.core.hashing import INLINE_KEYED_TOKENS, INLINE_TOKENS

__all__ = ["constants", "derived", "operator_keys", "reference", "show_config"]


def _leaves(section: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for every leaf of a config struct; a mapping of named
    entries (tenants, fault points) is one leaf."""
    for item in msgspec.structs.fields(section):
        value = getattr(section, item.name)
        if isinstance(value, msgspec.Struct):
            yield from _leaves(value, f"{prefix}{item.name}.")
        else:
            yield f"{prefix}{item.name}", msgspec.to_builtins(value)


def operator_keys(loaded: LoadedConfig) -> Iterator[tuple[str, Any, str]]:
    """``(key, value, source)`` for every operator key: ``file``, ``file (old key)``
    where it was migrated from an old key, or ``default``."""
    for key, value in _leaves(loaded.operator):
        if key in loaded.renamed:
            source = f"file ({loaded.renamed[key]})"
        else:
            source = "file" if has_path(loaded.written, key) else "default"
        yield key, value, source


def constants(loaded: LoadedConfig) -> Iterator[tuple[str, Any, str]]:
    """``(key, value, source)`` for every leaf of the effective tree: ``tuning`` where old
    keys or a test config set it, ``resolved`` where an operator key or the machine sets
    it (``pipeline.core.config.resolve.resolved``), else ``constant``."""
    by_resolution = resolved(loaded.operator, loaded.machine)
    for key, value in _leaves(loaded.config):
        if has_path(loaded.tuning, key):
            source = "tuning"
        else:
            source = "resolved" if has_path(by_resolution, key) else "constant"
        yield key, value, source


def derived(config: Config, machine: Machine | None = None) -> dict[str, Any]:
    """What the sidecar works out at start-up from ``config`` and this machine."""
    machine = machine or Machine.detect()
    staging = config.staging
    if config.store.backend == "embedded":
        data_path = "lent: values are copied into and out of the store's own memory"
    elif moves_in_place(config):
        data_path = "in place: Mooncake moves values between engine memory and the store"
    else:
        data_path = "staged: values are copied through the staging pool"
    return {
        "CPUs this process may run on": machine.cpus,
        "host memory (bytes)": machine.memory_bytes,
        "copy threads, for saves and for loads each": config.stages.transfer.threads,
        "staging pool (bytes)": staging.pool_bytes,
        "data path": data_path,
        "staging slots": staging.pool_bytes // staging.slot_bytes,
        "staging slots for loads": staging.load_slots,
        "mapped engine memory per engine (bytes)": config.limits.engine_mapped(),
        "mapped engine memory in all (bytes)": config.limits.total_mapped(),
        "prompts hashed on the event loop (tokens, at most)": INLINE_TOKENS,
        "the same with a LoRA, salt or multimodal items (tokens)": INLINE_KEYED_TOKENS,
        "saves copied on the event loop (bytes, at most)": INLINE_BYTES,
        "loads copied on the event loop (bytes, at most)": LOAD_INLINE_BYTES,
        "loads written around the caches from (bytes)": LOAD_STREAM_BYTES,
    }


def show_config(path: str | None, *, as_json: bool = False, everything: bool = False) -> None:
    """Print the effective config of ``path`` (the built-in defaults without one)."""
    loaded = read_config(path)
    rows = list(operator_keys(loaded))
    extra = derived(loaded.config, loaded.machine)
    if as_json:
        print(json.dumps({
            "config": {key: {"value": value, "source": source} for key, value, source in rows},
            "derived": extra,
            "effective": {key: {"value": value, "source": source}
                          for key, value, source in constants(loaded)},
            "notes": list(loaded.notes),
        }, indent=1))
        return
    console = Console()
    for note in loaded.notes:
        console.print(f"[yellow]old config:[/yellow] {note}")
    table = Table(title=f"kvsidecar config ({path or 'built-in defaults'})")
    for column in ("key", "value", "from"):
        table.add_column(column)
    for key, value, source in rows:
        table.add_row(key, json.dumps(value), source,
                      style="bold" if source != "default" else None)
    console.print(table)
    derived_table = Table(title="derived at start-up")
    derived_table.add_column("what")
    derived_table.add_column("value")
    for what, value in extra.items():
        derived_table.add_row(what, str(value))
    console.print(derived_table)
    if everything:
        effective = Table(title="the effective tree")
        for column in ("key", "value", "from"):
            effective.add_column(column)
        for key, value, source in constants(loaded):
            effective.add_row(key, json.dumps(value), source)
        console.print(effective)


# -- the reference -------------------------------------------------------------------------


def _field_docs(struct: type) -> dict[str, str]:
    """Each field's docstring, as written under it in the class body."""
    docs: dict[str, str] = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(struct))).body[0]
    assert isinstance(body, ast.ClassDef)
    for statement, following in zip(body.body, body.body[1:], strict=False):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


GROUPS = {
    "server": "Endpoint and security",
    "tenants": "Endpoint and security",
    "store": "Store and capacity",
    "metrics": "Observability",
    "events": "Observability",
    "logging": "Observability",
}


def _default_text(key: str, value: Any) -> str:
    if key == "server.endpoint":
        return "a socket in the sidecar's own directory"
    if key == "server.operators":
        return "the sidecar's own user"
    if key == "server.ipc_permissions":
        return "`0600`"
    if value is None:
        return "see meaning"
    return f"`{json.dumps(value)}`"


def _rows(struct: type, prefix: str) -> Iterator[tuple[str, str, str]]:
    docs = _field_docs(struct)
    default = struct()
    for item in msgspec.structs.fields(struct):
        key = f"{prefix}{item.name}"
        if isinstance(item.type, type) and issubclass(item.type, msgspec.Struct):
            yield from _rows(item.type, f"{key}.")
        elif key == "tenants":
            for name, text in _field_docs(TenantSection).items():
                yield f"tenants.NAME.{name}", "-", text
        else:
            yield key, _default_text(key, msgspec.to_builtins(getattr(default, item.name))), \
                docs.get(item.name, "")


def reference() -> str:
    """The configuration reference, in Markdown, from the typed operator config."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `kvsidecar config --reference`; a unit test checks that it is"
        " current. -->",
        "",
        "A config file holds the keys below and nothing else: every other setting is derived",
        "from them and from the machine, or is a named constant. `kvsidecar config --config",
        "FILE` shows what a file resolves to here, where each value came from, and what is",
        "derived; `--all` adds every constant. Unknown keys are refused, naming their path.",
        "",
    ]
    rows = list(_rows(OperatorConfig, ""))
    for group in dict.fromkeys(GROUPS.values()):
        lines += [f"## {group}", "", "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{key}` | {default} | {meaning.replace('|', '/')} |"
                  for key, default, meaning in rows if GROUPS[key.split(".")[0]] == group]
        lines.append("")
    lines += ["## Derived from the machine", ""]
    for key, name in (("stages.transfer.threads", "copy_threads"),
                      ("staging.pool_bytes", "staging_bytes")):
        doc = inspect.getdoc(getattr(Machine, name)) or ""
        lines.append(f"- `{key}`: {' '.join(doc.split())}")
    lines += [
        "",
        "## Upgrading an old config",
        "",
        "A file written for the old, longer config still loads. `kvsidecar serve` logs a",
        "`config.deprecated` warning, and `kvsidecar config` prints a line, for each thing",
        "the file should change:",
        "",
        "| old key | now |",
        "|---|---|",
    ]
    lines += [f"| `{old}` | {new} |" for old, new in RENAMED.items()]
    lines += [
        "",
        "Any other old key (stage inboxes and workers, staging sizes, limits, breaker and",
        "Mooncake internals) is no longer an operator setting: it is honoured, with one",
        "warning naming them all, and should be removed. Fault points (`faults`) are",
        "refused in an operator's file: tests pass them to `kvsidecar serve --test-config`.",
        "",
    ]
    return "\n".join(lines)
