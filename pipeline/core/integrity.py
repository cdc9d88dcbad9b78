"""Block integrity: an xxh3 checksum sealed after each stored value, checked on load.

A stored value is the block's payload followed by 8 bytes: xxh3-64 of the payload,
seeded with the layout fingerprint. A torn, corrupted or foreign value (another
geometry under the same key) fails the check before anything is copied to the engine,
and the block is reported failed instead.
"""

from __future__ import annotations

import sys

import torch
import xxhash

__all__ = [
    "CHECKSUM_BYTES",
    "VLLM_FORMAT_SEED",
    "checksum",
    "fingerprint_seed",
    "seal_rows",
    "verify_rows",
]

CHECKSUM_BYTES = 8
VLLM_FORMAT_SEED = 0
"""Seed of the checksums kept beside vLLM-format values (their keys name the engine;
a store seals a value that arrived without one with this seed too)."""


def fingerprint_seed(fingerprint: str) -> int:
    """A 64-bit checksum seed from a layout fingerprint (hex)."""
    return int(fingerprint[:16], 16)


def _digest(payload: torch.Tensor, seed: int) -> int:
    digest: int = xxhash.xxh3_64_intdigest(payload.numpy().data, seed)
    return digest


def checksum(payload: torch.Tensor, seed: int) -> bytes:
    """The 8 checksum bytes of one payload, as sealed after it."""
    return _digest(payload, seed).to_bytes(CHECKSUM_BYTES, sys.byteorder)


def seal_rows(rows: torch.Tensor, payload_bytes: int, seed: int) -> None:
    """Write each row's checksum after its ``payload_bytes`` of payload."""
    trailer = rows[:, payload_bytes : payload_bytes + CHECKSUM_BYTES]
    digests = [_digest(row[:payload_bytes], seed) for row in rows]
    trailer.copy_(
        torch.tensor(digests, dtype=torch.uint64).view(torch.uint8).view(len(digests), 8)
    )


def verify_rows(rows: torch.Tensor, payload_bytes: int, seed: int) -> list[bool]:
    """Whether each row's payload matches its sealed checksum."""
    stored = torch.empty((rows.shape[0], CHECKSUM_BYTES), dtype=torch.uint8)  # aligned
    stored.copy_(rows[:, payload_bytes : payload_bytes + CHECKSUM_BYTES])
    expected = stored.view(torch.uint64).view(-1).tolist()
    return [
        _digest(row[:payload_bytes], seed) == want
        for row, want in zip(rows, expected, strict=True)
    ]
