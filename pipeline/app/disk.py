"""``kvsidecar disk show|clear``: what a disk tier holds, and emptying it.

Both take the tier's lock as a sidecar does, so neither runs while a sidecar holds the
tier: stop it first. ``clear`` removes every segment file; the next sidecar on the tier
starts cold.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.backends.stores.disk.index import DiskIndex
from pipeline.backends.stores.disk.io import scan
from pipeline.backends.stores.disk.records import FORMAT_VERSION
from pipeline.backends.stores.disk.segments import TierDirectory
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError

__all__ = ["add_disk_arguments", "run_disk"]


def add_disk_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("show", "clear"),
                        help="show: what the tier holds; clear: remove every value in it")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--config", type=Path, help="the sidecar's config (its store.disk.path)")
    where.add_argument("--path", type=Path, help="the tier's directory")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _path(args: argparse.Namespace) -> Path:
    if args.path is not None:
        return Path(args.path)
    path = load_config(args.config).store.disk.path
    if not path:
        raise ConfigError("store.disk.path is not set: this config has no disk tier "
                          "(give --path, or --config of one that has)")
    return Path(path)


def run_disk(args: argparse.Namespace) -> int:
    """Show or clear the tier; the exit code."""
    path = _path(args)
    directory = TierDirectory(path, create=False)
    try:
        scanned = scan(directory)
        segments, dropped = scanned.segments, scanned.dropped
        index = DiskIndex()
        index.adopt(scanned.found, segments)
        summary: dict[str, Any] = {
            "path": str(path), "format_version": FORMAT_VERSION,
            "segments": len(segments),
            "segment_bytes": sum(segment.size for segment in segments.values()),
            "values": len(index),
            "value_bytes": {tenant or "-": held for tenant, held in index.tenant_bytes.items()},
            "dropped": dropped,
        }
        for segment in segments.values():
            segment.close()
        if scanned.unreadable:
            summary["unreadable_segments"] = scanned.unreadable
        if args.action == "clear":
            for number in directory.segment_numbers():
                directory.remove_segment(number)
            summary["cleared"] = True
    finally:
        directory.close()
    _print(summary, as_json=args.json)
    return 0


def _print(summary: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"disk tier at {summary['path']}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("segments",
                  f"{summary['segments']} ({summary['segment_bytes'] / 2**20:.0f} MiB)")
    table.add_row("values", str(summary["values"]))
    for tenant, held in summary["value_bytes"].items():
        table.add_row(f"  of tenant {tenant}", f"{held / 2**20:.1f} MiB on disk")
    table.add_row("records dropped as bad", json.dumps(summary["dropped"]))
    if summary.get("cleared"):
        table.add_row("cleared", "every segment removed: the next sidecar starts cold")
    Console().print(table)
