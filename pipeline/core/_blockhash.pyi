"""Chained block hashes without the GIL (``native/blockhash.c``)."""

from typing import Any

def chain(parent: bytes, tokens: Any, block_size: int) -> list[bytes]:
    """The sha256_cbor hash of ``(parent, tuple(block), None)`` for every full block of
    ``block_size`` native uint32 token ids in ``tokens`` (a buffer: ``array('I')``),
    each block's hash the next one's parent."""
