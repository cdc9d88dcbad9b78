"""Mooncake's return codes, and what each means for one key (see ``mooncake_store``)."""

from __future__ import annotations

from pipeline.core.outcomes import LOADED, MISSING, PRESENT, STORE_FULL, STORED, KeyOutcome, failed

__all__ = [
    "LEASE_EXPIRED",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_NOT_FOUND",
    "OK",
    "RPC_ERRORS",
    "get_outcome",
    "put_outcome",
]

OK = 0
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
RPC_ERRORS = range(-999, -899)
"""Mooncake's RPC error codes: -900 (the master is gone), -901 (it did not answer)."""


def put_outcome(code: int) -> KeyOutcome:
    """A ``batch_put_from`` per-key code as a store outcome."""
    if code == OK:
        return STORED
    if code == OBJECT_ALREADY_EXISTS:
        return PRESENT
    if code == NO_AVAILABLE_HANDLE:
        return STORE_FULL
    return failed(f"mooncake:{code}")


def get_outcome(code: int, expected: int) -> KeyOutcome:
    """A ``batch_get_into`` per-key code (bytes read, or an error) as a store outcome."""
    if code == expected:
        return LOADED
    if code == OBJECT_NOT_FOUND:
        return MISSING
    if code >= 0:
        return failed("size_mismatch")
    return failed(f"mooncake:{code}")
