"""The Mooncake store's check that a batch's pages lie in registered memory, judged a
column (one page of every value) at a time, against the check range by range."""

from __future__ import annotations

import numpy
from hypothesis import given
from hypothesis import strategies as st

from pipeline.backends.stores.mooncake.batches import columns_inside


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[tuple[int, int]], numpy.ndarray, list[int]]:
    """Registered ranges (side by side or apart, in any order; overlapping ones when drawn
    so) and a batch's page addresses: each column's pages in or near one range."""
    cuts = sorted(draw(st.sets(st.integers(0, 10_000), min_size=2, max_size=12)))
    ranges = [(low, high) for low, high in zip(cuts[::2], cuts[1::2], strict=False)]
    if draw(st.booleans()):  # a range overlapping another
        low, high = draw(st.sampled_from(ranges))
        ranges.append((low + (high - low) // 2, high + draw(st.integers(0, 500))))
    ranges = draw(st.permutations(ranges))
    columns = draw(st.integers(1, 4))
    values = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 64)) for _ in range(columns)]
    starts = numpy.zeros((values, columns), dtype=numpy.int64)
    for j in range(columns):
        low, high = draw(st.sampled_from(ranges))
        for i in range(values):
            starts[i, j] = draw(st.integers(low - 80, high + 16))
    return ranges, starts, sizes


def range_by_range(starts: numpy.ndarray, sizes: list[int],
                   ranges: list[tuple[int, int]]) -> bool:
    """Each column's lowest and highest page within some one range, every range tried."""
    return all(any(low <= int(starts[:, j].min()) and int(starts[:, j].max()) + size <= high
                   for low, high in ranges)
               for j, size in enumerate(sizes))


@given(layouts())
def test_a_column_is_judged_inside_only_if_one_range_holds_it(
    layout: tuple[list[tuple[int, int]], numpy.ndarray, list[int]],
) -> None:
    """Never inside where no range holds a column (the caller would send pages from
    memory Mooncake cannot read); with ranges that do not overlap, the same answer as
    trying every range. (Overlapping ones may send a batch to the exact check value by
    value instead.)"""
    ranges, starts, sizes = layout
    inside = columns_inside(starts, sizes, ranges)
    reference = range_by_range(starts, sizes, ranges)
    assert reference or not inside
    disjoint = all(a_high <= b_low for (_, a_high), (b_low, _) in
                   zip(sorted(ranges), sorted(ranges)[1:], strict=False))
    if disjoint:
        assert inside == reference
