"""Block checksums: sealed after the payload, any flipped byte or foreign seed detected."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.integrity import CHECKSUM_BYTES, fingerprint_seed, seal_rows, verify_rows


def rows(count: int, payload: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(count * 1000 + payload)
    return torch.randint(0, 256, (count, payload + CHECKSUM_BYTES), dtype=torch.uint8,
                         generator=generator)


def test_sealed_rows_verify_and_only_the_flipped_one_fails() -> None:
    """Every sealed row verifies; flipping one byte fails that row alone."""
    matrix = rows(4, 100)
    seal_rows(matrix, 100, 7)
    assert verify_rows(matrix, 100, 7) == [True] * 4
    matrix[2, 50] ^= 1
    assert verify_rows(matrix, 100, 7) == [True, True, False, True]


def test_a_foreign_seed_fails_every_row() -> None:
    """Values sealed for another layout fingerprint never verify."""
    matrix = rows(3, 64)
    seal_rows(matrix, 64, fingerprint_seed("00000000000000aa"))
    assert verify_rows(matrix, 64, fingerprint_seed("00000000000000ab")) == [False] * 3


@given(payload=st.integers(1, 300), flip=st.integers(0, 10_000), count=st.integers(1, 4))
def test_any_single_flip_in_payload_or_seal_is_caught(payload: int, flip: int, count: int) -> None:
    """A flipped byte anywhere in a row, checksum included, fails that row."""
    matrix = rows(count, payload)
    seal_rows(matrix, payload, 11)
    row, column = divmod(flip % (count * (payload + CHECKSUM_BYTES)), payload + CHECKSUM_BYTES)
    matrix[row, column] ^= 0x80
    assert verify_rows(matrix, payload, 11)[row] is False


def test_rows_at_unaligned_offsets_verify() -> None:
    """Rows whose seal is not 8-byte aligned (odd payload sizes) still verify."""
    matrix = rows(5, 61)
    seal_rows(matrix, 61, 3)
    assert verify_rows(matrix[1:], 61, 3) == [True] * 4
