"""A batch's values as runs: values that lie side by side in memory, one matrix each.

Memory lends a batch's values as runs and copy engines copy each run as one matrix (one
native call, one DMA transfer). A tensor per value would cost one to make where the
memory lends it and another to join back into a run where it is copied: about 10 µs a
value inside a busy sidecar, 16 to 32 values a request, on saves and loads alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "VALUE_ALIGN", "Run", "held", "lent_count", "select", "value_span", "value_views",
]

VALUE_ALIGN = 64
"""Values a store lends side by side start on a cache line. A value with its 8-byte
checksum would otherwise start 8 bytes further into a line at each row, and a gather
into rows that straddle lines takes about a quarter more CPU."""


def value_span(size: int, align: int = VALUE_ALIGN) -> int:
    """The bytes a lent value of ``size`` bytes occupies: itself, padded to ``align``."""
    return -(-size // align) * align


class Run:
    """Values of a batch that lie side by side: value ``first + i`` is row i of a
    matrix of ``count`` rows of ``size`` bytes, ``stride`` bytes apart from ``address``
    on (a store pads its values, ``value_span``).

    A copy engine of CPU memory reads only these numbers. The matrix as a torch view
    (``rows``) is made when first asked for, by CUDA copies and by calls that take values
    one by one: a store lending a run per batch (``Run.lent``) would otherwise make one
    per save and per load, and a torch call took 30 to 55 µs on a sidecar's event loop
    (measured), whose caches hold what the copies last passed through."""

    __slots__ = ("_base", "_offset", "_rows", "address", "count", "first", "size", "stride")

    def __init__(self, first: int, rows: torch.Tensor) -> None:
        """Row i of ``rows`` (uint8 ``[count, size]``, each row contiguous) is value
        ``first + i``."""
        self.first = first
        self.count, self.size = map(int, rows.shape)
        self.stride = rows.stride(0)
        self.address = rows.data_ptr()
        self._rows: torch.Tensor | None = rows
        self._base = rows
        self._offset = int(rows.storage_offset())

    @classmethod
    def lent(cls, first: int, base: torch.Tensor, storage_address: int, offset: int,
             count: int, size: int, stride: int) -> Run:
        """``count`` rows of ``size`` bytes, ``stride`` apart, from byte ``offset`` of the
        storage of ``base`` (a uint8 tensor), which starts at ``storage_address``."""
        run = cls.__new__(cls)
        run.first, run.count, run.size, run.stride = first, count, size, stride
        run.address = storage_address + offset
        run._rows, run._base, run._offset = None, base, offset
        return run

    @property
    def rows(self) -> torch.Tensor:
        """uint8 ``[count, size]``, a value a row."""
        if self._rows is None:
            self._rows = self._base.as_strided((self.count, self.size), (self.stride, 1),
                                               self._offset)
        return self._rows

    def part(self, start: int, stop: int, first: int) -> Run:
        """Its rows ``start`` to ``stop``, the first of them value ``first``."""
        skipped = start * self.stride
        run = Run.lent(first, self._base, self.address - self._offset,
                       self._offset + skipped, stop - start, self.size, self.stride)
        if (start, stop) == (0, self.count):
            run._rows = self._rows
        return run


def value_views(runs: Sequence[Run]) -> list[torch.Tensor]:
    """Each value's view (1-D), in the runs' order: for calls that take values one by one."""
    return [view for run in runs for view in run.rows.unbind(0)]


def lent_count(runs: Sequence[Run]) -> int:
    """How many values the runs hold."""
    return sum(run.count for run in runs)


def held(runs: Sequence[Run], count: int) -> bytearray:
    """Whether each of a batch's ``count`` positions has a value in ``runs``."""
    mask = bytearray(count)
    for run in runs:
        mask[run.first : run.first + run.count] = b"\x01" * run.count
    return mask


def select(runs: Sequence[Run], keep: Sequence[int]) -> list[Run]:
    """The values at positions ``keep`` (ascending, each in a run), numbered 0, 1, ... in
    that order: a run is split where a value of it is left out."""
    result = []
    k = 0
    for run in runs:
        end = run.first + run.count
        while k < len(keep) and keep[k] < end:
            if keep[k] < run.first:
                raise ValueError(f"position {keep[k]} has no value in the runs")
            start = k
            while k + 1 < len(keep) and keep[k + 1] == keep[k] + 1 and keep[k + 1] < end:
                k += 1
            k += 1
            offset = keep[start] - run.first
            result.append(run.part(offset, offset + k - start, start))
    if k < len(keep):
        raise ValueError(f"position {keep[k]} has no value in the runs")
    return result
