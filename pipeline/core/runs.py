"""A batch's values as runs: values that lie side by side in memory, one matrix each.

Memory lends a batch's values as runs and copy engines copy each run as one matrix (one
native call, one DMA transfer). A tensor per value would cost one to make where the
memory lends it and another to join back into a run where it is copied: about 10 µs a
value inside a busy sidecar, 16 to 32 values a request, on saves and loads alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "VALUE_ALIGN", "Run", "cut", "held", "lent_count", "select", "value_span", "value_views",
]

VALUE_ALIGN = 64
"""Values a store lends side by side start on a cache line. A value with its 8-byte
checksum would otherwise start 8 bytes further into a line at each row, and a gather
into rows that straddle lines takes about a quarter more CPU."""


def value_span(size: int, align: int = VALUE_ALIGN) -> int:
    """The bytes a lent value of ``size`` bytes occupies: itself, padded to ``align``."""
    return -(-size // align) * align


class Run(NamedTuple):
    """Values of a batch that lie side by side: value ``first + i`` is row i of ``rows``."""

    first: int
    """The batch position of its first value."""
    rows: torch.Tensor
    """uint8 ``[count, size]``, a value a row; rows may lie further apart than their size
    (a store pads its values, ``value_span``)."""


def value_views(runs: Sequence[Run]) -> list[torch.Tensor]:
    """Each value's view (1-D), in the runs' order: for calls that take values one by one."""
    return [view for run in runs for view in run.rows.unbind(0)]


def lent_count(runs: Sequence[Run]) -> int:
    """How many values the runs hold."""
    return sum(rows.shape[0] for _, rows in runs)


def held(runs: Sequence[Run], count: int) -> bytearray:
    """Whether each of a batch's ``count`` positions has a value in ``runs``."""
    mask = bytearray(count)
    for first, rows in runs:
        mask[first : first + rows.shape[0]] = b"\x01" * rows.shape[0]
    return mask


def cut(runs: Sequence[Run], start: int, stop: int) -> list[Run]:
    """The values at positions ``start`` to ``stop`` (each in a run), keeping their
    positions."""
    result = []
    for first, rows in runs:
        end = first + rows.shape[0]
        low, high = max(first, start), min(end, stop)
        if low >= high:
            continue
        whole = low == first and high == end
        result.append(Run(first, rows) if whole else Run(low, rows[low - first : high - first]))
    return result


def select(runs: Sequence[Run], keep: Sequence[int]) -> list[Run]:
    """The values at positions ``keep`` (ascending, each in a run), numbered 0, 1, ... in
    that order: a run is split where a value of it is left out."""
    result = []
    k = 0
    for first, rows in runs:
        end = first + rows.shape[0]
        while k < len(keep) and keep[k] < end:
            if keep[k] < first:
                raise ValueError(f"position {keep[k]} has no value in the runs")
            start = k
            while k + 1 < len(keep) and keep[k + 1] == keep[k] + 1 and keep[k + 1] < end:
                k += 1
            k += 1
            offset = keep[start] - first
            part = rows if k - start == rows.shape[0] else rows[offset : offset + k - start]
            result.append(Run(start, part))
    if k < len(keep):
        raise ValueError(f"position {keep[k]} has no value in the runs")
    return result
