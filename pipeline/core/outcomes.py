"""What happened to one block: the outcome every store call and every stage reports.

Pure values (no torch), so that the wire messages can carry them without the store.
"""

from __future__ import annotations

import enum

import msgspec

from pipeline.core.errors import InternalFailure, StoreError, StoreUnavailable

__all__ = [
    "CANCELLED",
    "CHANGED",
    "DEADLINE",
    "DISCARDED",
    "LOADED",
    "MISSING",
    "OVERLOADED",
    "PRESENT",
    "STORED",
    "STORE_FULL",
    "STORE_UNAVAILABLE",
    "BlockStatus",
    "KeyOutcome",
    "failed",
    "stopped",
    "store_error_outcome",
]


class BlockStatus(enum.StrEnum):
    STORED = "stored"
    PRESENT = "present"
    SKIPPED = "skipped"
    FAILED = "failed"
    LOADED = "loaded"
    MISSING = "missing"


class KeyOutcome(msgspec.Struct, frozen=True):
    status: BlockStatus
    reason: str = ""


STORED = KeyOutcome(BlockStatus.STORED)
PRESENT = KeyOutcome(BlockStatus.PRESENT)
LOADED = KeyOutcome(BlockStatus.LOADED)
MISSING = KeyOutcome(BlockStatus.MISSING, "missing")
STORE_FULL = KeyOutcome(BlockStatus.SKIPPED, "store_full")
STORE_UNAVAILABLE = KeyOutcome(BlockStatus.SKIPPED, "store_unavailable")
INTERNAL = KeyOutcome(BlockStatus.FAILED, "internal")
"""The sidecar failed on the block's request (a bug, answered rather than crashing)."""
MEMORY_LOST = KeyOutcome(BlockStatus.FAILED, "engine_memory_lost")
"""The engine's memory file shrank under the sidecar during the copy: what was read is
not its KV (never stored), what was written did not reach it."""
OVERLOADED = KeyOutcome(BlockStatus.SKIPPED, "overloaded")
"""A save refused as the sidecar's save path is full, or shed by the engine's client
that was told so (``SaveDone.save_credits``)."""
CANCELLED = "cancelled"
"""Why a block was not moved: its engine cancelled the request (``Cancel``)."""
DEADLINE = "deadline"
"""Why a block was not moved: its request's deadline passed before its copy started."""
CHANGED = KeyOutcome(BlockStatus.SKIPPED, "changed_during_copy")
"""A save's block the engine wrote while it was being copied (the fence broken): what
was copied may be torn, and is never stored."""
DISCARDED = KeyOutcome(BlockStatus.SKIPPED, "discarded")
"""A save's block copied in one batch with a block of a request stopped meanwhile, or
with a block changed during the copy: the batch is dropped whole, never stored."""


def stopped(reason: str, *, saving: bool) -> KeyOutcome:
    """The outcome of a block whose request was stopped before its copy (``reason``:
    ``CANCELLED``, ``DEADLINE``, the session closed, shutdown): a save's is skipped, a
    load's failed (the engine recomputes it)."""
    return KeyOutcome(BlockStatus.SKIPPED if saving else BlockStatus.FAILED, reason)


def failed(reason: str) -> KeyOutcome:
    return KeyOutcome(BlockStatus.FAILED, reason)


def store_error_outcome(exc: StoreError, *, saving: bool) -> KeyOutcome:
    """The outcome of blocks whose whole batch met a store error.

    Saves are a cache fill: while the store is known to be down they are skipped.
    """
    if saving and isinstance(exc, StoreUnavailable):
        return STORE_UNAVAILABLE
    if isinstance(exc, InternalFailure):
        return failed("internal")
    return failed(f"store: {exc}")
