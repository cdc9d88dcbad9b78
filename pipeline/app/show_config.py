"""``kvsidecar config``: the effective config, each value with where it came from, and
the values the sidecar derives from it and from the machine at start-up."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from pipeline.app.backends import moves_in_place
from pipeline.backends.cpu_copy import INLINE_BYTES, LOAD_INLINE_BYTES, LOAD_STREAM_BYTES
from pipeline.core.config import Config, load_config
from pipeline.core.hashing import INLINE_KEYED_TOKENS, INLINE_TOKENS

__all__ = ["derived", "effective", "show_config"]


def effective(config: Config, written: Mapping[str, Any]) -> Iterator[tuple[str, Any, str]]:
    """``(key, value, source)`` for every leaf of ``config``: ``file`` where ``written``
    (the YAML document as read) sets it, else ``default``. A mapping of named entries
    (tenants, fault points) is one leaf."""

    def walk(section: Any, document: Any, prefix: str) -> Iterator[tuple[str, Any, str]]:
        for field in msgspec.structs.fields(section):
            value = getattr(section, field.name)
            key = f"{prefix}{field.name}"
            given = document.get(field.name) if isinstance(document, Mapping) else None
            if isinstance(value, msgspec.Struct):
                yield from walk(value, given, f"{key}.")
            else:
                source = ("file" if isinstance(document, Mapping) and field.name in document
                          else "default")
                yield key, msgspec.to_builtins(value), source

    return walk(config, written, "")


def derived(config: Config) -> dict[str, Any]:
    """What the sidecar works out at start-up from ``config`` and this machine."""
    staging = config.staging
    if config.store.backend == "embedded":
        data_path = "lent: values are copied into and out of the store's own memory"
    elif moves_in_place(config):
        data_path = "in place: Mooncake moves values between engine memory and the store"
    else:
        data_path = "staged: values are copied through the staging pool"
    return {
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


def show_config(path: str | None, *, as_json: bool = False) -> None:
    """Print the effective config of ``path`` (the built-in defaults without one)."""
    config = load_config(path)
    written: Any = {}
    if path is not None:
        written = msgspec.yaml.decode(Path(path).read_bytes()) or {}
    rows = list(effective(config, written))
    extra = derived(config)
    if as_json:
        print(json.dumps({"config": {key: {"value": value, "source": source}
                                     for key, value, source in rows},
                          "derived": extra}, indent=1))
        return
    table = Table(title=f"kvsidecar config ({path or 'built-in defaults'})")
    for column in ("key", "value", "from"):
        table.add_column(column)
    for key, value, source in rows:
        table.add_row(key, json.dumps(value), source,
                      style="bold" if source == "file" else None)
    console = Console()
    console.print(table)
    derived_table = Table(title="derived at start-up")
    derived_table.add_column("what")
    derived_table.add_column("value")
    for what, value in extra.items():
        derived_table.add_row(what, str(value))
    console.print(derived_table)
