"""A disk tier under the embedded store: values written behind memory, read back
checked, kept across restarts (``tier`` says how)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import structlog

from pipeline.backends.stores.disk.io import scan
from pipeline.backends.stores.disk.segments import TierDirectory
from pipeline.backends.stores.disk.tier import DiskTier, Fault
from pipeline.core.config import DiskStoreConfig
from pipeline.core.errors import StoreError

__all__ = ["DiskTier", "open_disk_tier"]

log = structlog.get_logger("kvsidecar.store.disk")


@contextlib.asynccontextmanager
async def open_disk_tier(config: DiskStoreConfig, *, fault: Fault | None = None,
                         ) -> AsyncIterator[DiskTier]:
    """The tier at ``config.path``: locked, scanned (its index rebuilt from the records
    found), writing while the context is open; closed and unlocked on exit. A segment
    file that cannot be read is left alone, and logged."""
    directory = TierDirectory(Path(config.path))
    scanned = None
    try:
        scanned = await anyio.to_thread.run_sync(scan, directory)
        tier = DiskTier(directory, config, fault=fault)
        tier.adopt(scanned)
    except BaseException as exc:
        for segment in scanned.segments.values() if scanned is not None else ():
            segment.close()
        directory.close()
        if isinstance(exc, OSError):
            raise StoreError(f"cannot read the disk tier at {config.path}: {exc}") from exc
        raise
    for number, error in scanned.unreadable.items():
        log.warning("store.disk.segment_unreadable", path=config.path, segment=number,
                    error=error, consequence="left in place; its values are not served")
    log.info("store.disk.opened", path=config.path, records=len(tier.index),
             segments=len(tier.space.segments), dropped=scanned.dropped or None,
             budget_bytes=config.bytes)
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(config.writers):
                tg.start_soon(tier.run_writer)
            try:
                yield tier
            finally:
                tg.cancel_scope.cancel()
    finally:
        tier.close()
