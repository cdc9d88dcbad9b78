"""Fault points that corrupt values: which values, how many, and where."""

from __future__ import annotations

import msgspec
import torch

from pipeline.backends.faults import Faults
from pipeline.core.config import FaultsConfig


def faults(**point: object) -> Faults:
    return Faults(msgspec.convert({"points": {"store.put": {"corrupt_rate": 1.0, **point}}},
                                  FaultsConfig))


def test_a_targeted_corruption_flips_one_span_of_the_first_value_of_one_group() -> None:
    """``corrupt_key`` picks the values, ``corrupt_limit`` how many, ``corrupt_at`` and
    ``corrupt_span`` which bytes: a negative control that damages one block of one
    store group and nothing else."""
    point = faults(corrupt_key="@group:1@", corrupt_limit=1, corrupt_at=0.5, corrupt_span=8)
    keys = ["m@group:0@a", "m@group:1@b", "m@group:1@c"]
    values = [torch.zeros(64, dtype=torch.uint8) for _ in keys]
    point.corrupt("store.put", values, keys)
    point.corrupt("store.put", values, keys)  # the limit holds across calls
    flipped = [torch.nonzero(value).flatten().tolist() for value in values]
    assert flipped == [[], list(range(32, 40)), []]
    assert point.fired == {"store.put.corrupt": 1}


def test_a_keyed_point_corrupts_nothing_it_cannot_match_and_a_plain_one_everything() -> None:
    keyed, plain = faults(corrupt_key="@group:1@"), faults()
    values = [torch.zeros(16, dtype=torch.uint8) for _ in range(3)]
    keyed.corrupt("store.put", values)  # no keys: nothing matches
    assert all(not value.any() for value in values)
    plain.corrupt("store.put", values)
    assert [int(value.count_nonzero()) for value in values] == [1, 1, 1]
