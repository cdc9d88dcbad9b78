"""Shared-memory mappings that survive their file being shrunk (``native/memguard.c``).

A SIGBUS inside a watched mapping replaces the whole mapping in place with anonymous
zero pages and marks it lost; the faulting access resumes. Any other SIGBUS goes to
the handler installed before. Unwatch a mapping before closing it.
"""

from typing import Any

Buffer = Any
"""A page-aligned buffer over a mapping (``mmap.mmap``); its export is released at once."""

def watch(mapping: Buffer) -> int:
    """Watch the mapping (installing the SIGBUS handler, again if something replaced it);
    a token unique to this watch. ``ValueError`` for an empty or unaligned buffer,
    ``OverflowError`` when all 4096 slots are watched."""

def lost(token: int) -> bool:
    """Whether a fault replaced the watched mapping with zeros; False for a token that is
    no longer (or never was) watched."""

def unwatch(token: int) -> None:
    """Stop watching; does nothing for a stale token (its slot may watch another)."""

def watched() -> int:
    """How many mappings are watched."""
