"""Edges: the bounded streams between stages, each with a named end per side."""

from __future__ import annotations

import dataclasses
import math
from typing import Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["Edge", "create_edge"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Edge(Generic[T]):
    """A bounded stream from one stage to the next: the producer's ``outbox``, the
    consumer's ``inbox``."""

    outbox: MemoryObjectSendStream[T]
    inbox: MemoryObjectReceiveStream[T]
    size: int

    def close(self) -> None:
        self.outbox.close()
        self.inbox.close()


def create_edge(size: int) -> Edge[T]:
    """A bounded edge (``size`` comes from config, never infinite)."""
    if not 0 < size < math.inf:
        raise ValueError(f"edge size must be finite and positive, got {size}")
    outbox, inbox = anyio.create_memory_object_stream[T](max_buffer_size=size)
    return Edge(outbox, inbox, size)
