"""A batch's values as runs: selected and told apart without losing or moving a value."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.runs import Run, held, lent_count, select, value_views

SIZE = 4
SPAN = 8
"""Values lie SPAN bytes apart, as a store pads them."""


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Run], int]:
    """Runs over a batch of up to 12 positions, some with no value, over one memory whose
    value i (by position) holds the bytes i: runs of 1 to 4 values, gaps between them,
    each made from a view or lent by its numbers (its view made when asked for)."""
    count = draw(st.integers(0, 12))
    memory = torch.arange(count, dtype=torch.uint8).repeat_interleave(SPAN)
    runs = []
    position = 0
    while position < count:
        length = draw(st.integers(1, min(4, count - position)))
        if draw(st.booleans()):
            if draw(st.booleans()):
                rows = memory.view(count, SPAN)[position : position + length, :SIZE]
                runs.append(Run(position, rows))
            else:
                runs.append(Run.lent(position, memory, memory.data_ptr(), position * SPAN,
                                     length, SIZE, SPAN))
        position += length
    return runs, count


def positions_of(runs: list[Run]) -> list[int]:
    """The position each value holds (its bytes say which), in the runs' order, each run
    checked to be where its numbers say."""
    for run in runs:
        rows = run.rows
        assert (run.address, run.stride, run.count, run.size) == (
            rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1])
        assert rows.stride(1) == 1
    return [int(view[0]) for view in value_views(runs)]


@given(batches(), st.data())
def test_select_keeps_exactly_the_values_asked_for_in_order_and_numbers_them_afresh(
    batch: tuple[list[Run], int], data: st.DataObject,
) -> None:
    """The values kept are those at the positions asked for, in order, numbered 0, 1, ...
    with no gap, and each is the very memory of its value (nothing copied)."""
    runs, count = batch
    lent = [position for position, has in enumerate(held(runs, count)) if has]
    keep = sorted(data.draw(st.sets(st.sampled_from(lent)) if lent else st.just(set())))
    selected = select(runs, keep)
    assert positions_of(selected) == keep
    numbered = [run.first + i for run in selected for i in range(run.rows.shape[0])]
    assert numbered == list(range(len(keep)))
    originals = {int(view[0]): view.data_ptr() for view in value_views(runs)}
    assert [view.data_ptr() for view in value_views(selected)] == [originals[p] for p in keep]


def test_held_says_which_positions_have_a_value() -> None:
    """Positions covered by a run are held and counted; the others, and a batch with no
    runs, not."""
    memory = torch.zeros(5, SIZE, dtype=torch.uint8)
    runs = [Run(1, memory[1:3]), Run(4, memory[4:5])]
    assert held(runs, 5) == bytearray([0, 1, 1, 0, 1]) and lent_count(runs) == 3
    assert held([], 3) == bytearray(3) and lent_count([]) == 0


def test_select_refuses_a_position_no_run_holds() -> None:
    """Asking for a position without a value is an error, not a wrong value."""
    memory = torch.zeros(4, SIZE, dtype=torch.uint8)
    runs = [Run(0, memory[0:2]), Run(3, memory[3:4])]
    with pytest.raises(ValueError, match="position 2"):
        select(runs, [0, 2])
    with pytest.raises(ValueError, match="position 5"):
        select(runs, [3, 5])
