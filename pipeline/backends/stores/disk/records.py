"""The disk tier's records: one stored value each, self-describing and checked.

A record starts at a multiple of ``BLOCK`` bytes of its segment file and spans a
multiple of it::

    header (64 bytes) | key | tenant | fingerprint | value | zeros up to a BLOCK

The header, little-endian:

====== ===== ==================================================================
offset bytes
====== ===== ==================================================================
0      4     magic ``KVSD``
4      2     format version (``FORMAT_VERSION``)
6      2     key bytes (UTF-8)
8      2     tenant bytes (UTF-8)
10     2     layout fingerprint bytes (ASCII)
12     4     flags: 1 marks a removal (a tombstone, no value); other bits zero
16     8     value bytes
24     8     sequence: of two records under one key, the later one stands
32     8     xxh3-64 of the value
40     8     BLAKE2b-64 of bytes 0 to 39 and the key, tenant and fingerprint, keyed
             with the tier's secret
48     16    reserved, zero
====== ===== ==================================================================

The last checksum covers the version, key, tenant, fingerprint and value (through the
value's checksum). A record is read back only if its magic, version and header checksum
hold and its value matches its checksum: a record cut off mid-write, with a byte flipped
anywhere, or of another format version is dropped, never loaded. The header checksum is
keyed with a secret of the tier's (a 0600 file in its directory), so that a record
forged inside a value an engine stored never passes for a record of its own, should a
scan look for records inside it (it does after a damaged one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy
import xxhash

__all__ = [
    "BLOCK",
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "MAX_NAMES_BYTES",
    "Header",
    "HeaderProblem",
    "encode",
    "parse_header",
    "record_span",
    "value_matches",
]

MAGIC = b"KVSD"
FORMAT_VERSION = 1
BLOCK = 4096
"""Records start and end on multiples of it: the alignment direct I/O needs."""
HEADER = struct.Struct("<4sHHHHIQQQQ16x")
_CHECKED = 40
"""Header bytes the header checksum covers (all but itself and the reserved tail)."""
MAX_NAMES_BYTES = BLOCK - HEADER.size
"""Key, tenant and fingerprint together fit the record's first block, so that reading
one block tells a scan everything but the value."""


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    key: str
    tenant: str
    fingerprint: str
    size: int
    """Value bytes."""
    sequence: int
    value_checksum: int
    removal: bool
    """A tombstone: the key's earlier records no longer stand."""
    value_offset: int
    """Where the value starts, from the record's start."""
    span: int
    """The record's bytes on disk, padding included."""


@dataclasses.dataclass(frozen=True, slots=True)
class HeaderProblem:
    reason: str
    """``no_record`` (no magic: never written, or not a record's start), ``version``
    (a format this sidecar does not read), ``checksum`` or ``malformed``."""


def _names(key: str, tenant: str, fingerprint: str) -> tuple[bytes, bytes, bytes]:
    return key.encode(), tenant.encode(), fingerprint.encode("ascii")


def record_span(key: str, tenant: str, fingerprint: str, size: int) -> int | None:
    """The bytes a record of a ``size``-byte value takes on disk; None if its names do
    not fit its first block."""
    names = sum(map(len, _names(key, tenant, fingerprint)))
    if names > MAX_NAMES_BYTES:
        return None
    return -(-(HEADER.size + names + size) // BLOCK) * BLOCK


REMOVAL = 1
MAX_SEQUENCE = (1 << 63) - 1


def _header_checksum(head: bytes | memoryview, names: bytes | memoryview,
                     secret: bytes) -> int:
    digest = hashlib.blake2b(digest_size=8, key=secret)
    digest.update(head[:_CHECKED])
    digest.update(names)
    return int.from_bytes(digest.digest(), "little")


def encode(out: numpy.ndarray, key: str, tenant: str, fingerprint: str,
           value: numpy.ndarray, sequence: int, secret: bytes) -> int:
    """Write a record of ``value`` (uint8; empty: a tombstone) at the start of ``out``
    (uint8, at least its span long), its header checksum keyed with ``secret``; its
    span. Runs in an I/O thread."""
    key_bytes, tenant_bytes, fingerprint_bytes = _names(key, tenant, fingerprint)
    names = key_bytes + tenant_bytes + fingerprint_bytes
    size = value.size
    value_offset = HEADER.size + len(names)
    span = -(-(value_offset + size) // BLOCK) * BLOCK
    out[value_offset : value_offset + size] = value
    out[value_offset + size : span] = 0
    value_checksum = xxhash.xxh3_64_intdigest(out[value_offset : value_offset + size].data)
    head = HEADER.pack(MAGIC, FORMAT_VERSION, len(key_bytes), len(tenant_bytes),
                       len(fingerprint_bytes), 0 if size else REMOVAL, size, sequence,
                       value_checksum, 0)
    checksum = _header_checksum(head, names, secret)
    head = head[:_CHECKED] + struct.pack("<Q", checksum) + head[48:]
    out[: HEADER.size] = numpy.frombuffer(head, dtype=numpy.uint8)
    out[HEADER.size : value_offset] = numpy.frombuffer(names, dtype=numpy.uint8)
    return span


def parse_header(block: bytes | memoryview, secret: bytes) -> Header | HeaderProblem:
    """The header at the start of ``block`` (a record's first ``BLOCK`` bytes), checked
    with the tier's ``secret``."""
    if len(block) < HEADER.size or bytes(block[:4]) != MAGIC:
        return HeaderProblem("no_record")
    (_, version, key_len, tenant_len, fingerprint_len, flags, size, sequence,
     value_checksum, header_checksum) = HEADER.unpack_from(block)
    if version != FORMAT_VERSION:
        return HeaderProblem("version")
    names_end = HEADER.size + key_len + tenant_len + fingerprint_len
    if names_end > len(block) or names_end > BLOCK:
        return HeaderProblem("malformed")
    names = block[HEADER.size : names_end]
    if _header_checksum(block, names, secret) != header_checksum:
        return HeaderProblem("checksum")
    if flags & ~REMOVAL or bool(flags) == bool(size) or sequence > MAX_SEQUENCE:
        return HeaderProblem("malformed")
    try:
        key = bytes(names[:key_len]).decode()
        tenant = bytes(names[key_len : key_len + tenant_len]).decode()
        fingerprint = bytes(names[key_len + tenant_len :]).decode("ascii")
    except UnicodeDecodeError:
        return HeaderProblem("malformed")
    span = -(-(names_end + size) // BLOCK) * BLOCK
    return Header(key, tenant, fingerprint, size, sequence, value_checksum, bool(flags),
                  names_end, span)


def value_matches(record: numpy.ndarray, header: Header) -> bool:
    """Whether the value in ``record`` (the record's bytes from its start) matches the
    checksum its header carries."""
    value = record[header.value_offset : header.value_offset + header.size]
    return bool(value.size == header.size
                and xxhash.xxh3_64_intdigest(value.data) == header.value_checksum)
