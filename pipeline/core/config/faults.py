"""Fault injection, for tests: the named points where faults fire, and what each does.
Set only from a test config (``kvsidecar serve --test-config``); an operator's file that
names fault points is refused."""

from __future__ import annotations

from typing import Annotated

import msgspec

from pipeline.core.config.base import Section

__all__ = ["FAULT_POINTS", "FaultPointConfig", "FaultsConfig"]


FAULT_POINTS = frozenset({
    "stage.group_filter", "stage.hashing", "stage.dedup", "stage.transfer", "stage.commit",
    "stage.fetch", "stage.scatter", "store.exists", "store.put", "store.get",
    "receive.accepted", "transfer.copied", "disk.write", "disk.read",
})
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]


class FaultPointConfig(Section, frozen=True):
    """What one point does. ``disk.write`` and ``disk.read`` only fail (an I/O error, at
    ``error_rate``): they neither delay nor corrupt."""

    error_rate: Probability = 0.0
    """Probability that one call at this point fails."""
    delay_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Added to every call at this point."""
    corrupt_rate: Probability = 0.0
    """Probability that one value gets flipped bytes: at ``store.put`` the value as
    stored (every later load of it must fail), at ``store.get`` the copy one load
    receives (copying backends; lent memory is shared by readers)."""
    corrupt_key: str = ""
    """Only values whose key contains this (e.g. ``@group:1@``, one store group)."""
    corrupt_limit: Annotated[int, msgspec.Meta(ge=0)] = 0
    """At most this many values are corrupted at this point (0: no limit)."""
    corrupt_at: Annotated[float, msgspec.Meta(ge=0, lt=1)] | None = None
    """Where in the value the flipped bytes start, as a fraction of its size (None: a
    random byte)."""
    corrupt_span: Annotated[int, msgspec.Meta(ge=1)] = 1
    """How many consecutive bytes are flipped."""


class FaultsConfig(Section, frozen=True):
    """Fault injection for testing: off unless points are named."""

    seed: int = 0
    points: dict[str, FaultPointConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.points) - FAULT_POINTS
        if unknown:
            raise ValueError(
                f"unknown fault points {sorted(unknown)}; known: {sorted(FAULT_POINTS)}"
            )
