"""Disk tier records: what is written is read back whole, and any damage is caught."""

from __future__ import annotations

import hashlib
import struct

import numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.backends.stores.disk.records import (
    BLOCK,
    FORMAT_VERSION,
    HEADER,
    MAX_NAMES_BYTES,
    Header,
    HeaderProblem,
    encode,
    parse_header,
    record_span,
    value_matches,
)

SECRET = bytes(range(32))
names = st.text(min_size=0, max_size=80)
fingerprints = st.text(alphabet="0123456789abcdef", max_size=32)
values = st.binary(min_size=1, max_size=3 * BLOCK)


def encoded(key: str, tenant: str, fingerprint: str, value: bytes,
            sequence: int = 7) -> tuple[numpy.ndarray, int]:
    span = record_span(key, tenant, fingerprint, len(value))
    assert span is not None
    out = numpy.full(span + BLOCK, 0xAB, dtype=numpy.uint8)  # dirty: padding must be zeroed
    written = encode(out, key, tenant, fingerprint, numpy.frombuffer(value, dtype=numpy.uint8),
                     sequence, SECRET)
    assert written == span
    return out[:span], span


@settings(max_examples=200, deadline=None)
@given(names, names, fingerprints, values, st.integers(0, 2**63 - 1))
def test_a_record_reads_back_as_it_was_written(key: str, tenant: str, fingerprint: str,
                                               value: bytes, sequence: int) -> None:
    """Every field and the value come back, the span is whole blocks, the tail is zeros."""
    record, span = encoded(key, tenant, fingerprint, value, sequence)
    header = parse_header(record[:BLOCK].data, SECRET)
    assert isinstance(header, Header)
    assert (header.key, header.tenant, header.fingerprint, header.size, header.sequence,
            header.span) == (key, tenant, fingerprint, len(value), sequence, span)
    assert span % BLOCK == 0
    assert value_matches(record, header)
    end = header.value_offset + header.size
    assert bytes(record[header.value_offset : end]) == value
    assert not record[end:].any()


@settings(max_examples=300, deadline=None)
@given(names, fingerprints, values, st.data())
def test_any_flipped_byte_of_a_record_is_caught(key: str, fingerprint: str, value: bytes,
                                                data: st.DataObject) -> None:
    """A flip anywhere in the header, the names or the value: the header is refused or
    the value fails its checksum; never a record that reads back different."""
    record, _ = encoded(key, "tenant", fingerprint, value)
    end = HEADER.size + len(key.encode()) + len("tenant") + len(fingerprint) + len(value)
    position = data.draw(st.integers(0, end - 1))
    if 48 <= position < HEADER.size:
        return  # the reserved tail: never read, so a flip there changes nothing read
    record[position] ^= data.draw(st.integers(1, 255))
    header = parse_header(record[:BLOCK].data, SECRET)
    assert isinstance(header, HeaderProblem) or not value_matches(record, header)


def test_a_record_checks_out_only_under_its_tiers_secret() -> None:
    """A record made under another secret (forged inside a value, say) is refused: its
    header checksum does not hold."""
    record, _ = encoded("key", "tenant", "ff", b"value")
    assert parse_header(record[:BLOCK].data, bytes(32)) == HeaderProblem("checksum")


def test_a_tombstone_has_no_value_and_says_so() -> None:
    """An empty value is written as a removal; flags and size must agree."""
    record, span = encoded("key", "", "", b"")
    header = parse_header(record[:BLOCK].data, SECRET)
    assert isinstance(header, Header) and header.removal and header.size == 0
    assert span == BLOCK
    value, _ = encoded("key", "", "", b"v")
    parsed = parse_header(value[:BLOCK].data, SECRET)
    assert isinstance(parsed, Header) and not parsed.removal


def test_a_record_of_another_format_version_is_refused() -> None:
    """A version this sidecar does not know is refused even when its checksum holds."""
    record, _ = encoded("key", "tenant", "ff", b"value")
    record[4:6] = numpy.frombuffer(struct.pack("<H", FORMAT_VERSION + 1), dtype=numpy.uint8)
    names = bytes(record[HEADER.size : HEADER.size + 3 + 6 + 2])
    digest = hashlib.blake2b(digest_size=8, key=SECRET)
    digest.update(bytes(record[:40]))
    digest.update(names)
    record[40:48] = numpy.frombuffer(digest.digest(), dtype=numpy.uint8)
    assert parse_header(record[:BLOCK].data, SECRET) == HeaderProblem("version")


def test_nothing_written_is_no_record() -> None:
    """Zeros (a segment's unwritten tail) are no record, not a damaged one."""
    assert parse_header(bytes(BLOCK), SECRET) == HeaderProblem("no_record")


def test_names_that_overflow_the_first_block_are_not_recorded() -> None:
    """Key, tenant and fingerprint must fit the record's first block."""
    assert record_span("k" * MAX_NAMES_BYTES, "", "", 1) is not None
    assert record_span("k" * MAX_NAMES_BYTES, "t", "", 1) is None
