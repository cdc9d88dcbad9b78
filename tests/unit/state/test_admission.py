"""The admission policy on its own: the order messages are dispatched in, and which
saves are taken."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.state.admission import Admission, SaveVerdict


def order(kinds: str, *, max_held: int = Admission.MAX_HELD) -> list[int]:
    """Dispatch order of messages all waiting at the socket at once ("s" save, "l" load
    or lookup, "h" anything else), as the receive loop asks the policy."""
    admission = Admission[int](shed_saves=True, save_credits=32)
    admission.MAX_HELD = max_held
    out: list[int] = []
    for index, kind in enumerate(kinds):
        while (held := admission.next_held(frames_waiting=True)) is not None:
            out.append(held)
        waiting = index < len(kinds) - 1
        if admission.goes_now(is_save=kind == "s", is_load_or_lookup=kind == "l",
                              frames_waiting=waiting):
            out.append(index)
        else:
            admission.hold(index)
    while (held := admission.next_held(frames_waiting=False)) is not None:
        out.append(held)
    return out


def test_loads_and_lookups_go_before_the_saves_read_ahead_of_them() -> None:
    """Saves read while frames wait are held; the load and lookup behind them go first,
    and a heartbeat keeps its place behind the saves."""
    assert order("sslhs") == [2, 0, 1, 3, 4]


def test_a_save_read_with_nothing_behind_it_goes_at_once() -> None:
    admission = Admission[int](shed_saves=True, save_credits=1)
    assert admission.goes_now(is_save=True, is_load_or_lookup=False, frames_waiting=False)
    assert admission.goes_now(is_save=False, is_load_or_lookup=False, frames_waiting=True)


def test_past_max_held_the_oldest_goes_before_the_next_frame_is_read() -> None:
    """With more saves than may be held, one is let go per frame read once the bound is
    reached, so the queue never grows past it."""
    assert order("sssssl", max_held=3) == [0, 1, 2, 5, 3, 4]


@given(st.text(alphabet="slh", max_size=40), st.integers(1, 8))
def test_every_message_is_dispatched_once_and_none_is_held_past_the_bound(
    kinds: str, max_held: int,
) -> None:
    """Whatever arrives, each message is dispatched exactly once; saves and the messages
    behind them keep their relative order; loads and lookups keep theirs."""
    got = order(kinds, max_held=max_held)
    assert sorted(got) == list(range(len(kinds)))
    fast = [i for i in got if kinds[i] == "l"]
    slow = [i for i in got if kinds[i] != "l"]
    assert fast == sorted(fast) and slow == sorted(slow)


@pytest.mark.parametrize(("in_flight", "room", "verdict"), [
    (0, 5, SaveVerdict.QUEUE),
    (1, 5, SaveVerdict.QUEUE),
    (2, 5, SaveVerdict.REFUSE),  # past its credits
    (0, 0, SaveVerdict.REFUSE),  # the save path is full
])
def test_shedding_refuses_a_save_past_its_engines_credits_or_the_paths_room(
    in_flight: int, room: int, verdict: SaveVerdict,
) -> None:
    admission = Admission[int](shed_saves=True, save_credits=2)
    assert admission.on_save(saves_in_flight=in_flight, room=room) is verdict


def test_backpressure_never_refuses_a_save_and_waits_for_room() -> None:
    admission = Admission[int](shed_saves=False, save_credits=2)
    assert admission.on_save(saves_in_flight=50, room=0) is SaveVerdict.WAIT
    assert admission.on_save(saves_in_flight=50, room=1) is SaveVerdict.QUEUE
    assert admission.credits(saves_in_flight=50, room=0) == -1


def test_credits_are_what_is_left_of_the_engines_share_within_the_paths_room() -> None:
    admission = Admission[int](shed_saves=True, save_credits=4)
    assert admission.credits(saves_in_flight=1, room=10) == 3
    assert admission.credits(saves_in_flight=1, room=2) == 2
    assert admission.credits(saves_in_flight=6, room=10) == 0


def test_refusals_are_summed_per_engine_and_reported_once() -> None:
    admission = Admission[int](shed_saves=True, save_credits=1)
    for engine in ("a", "b", "a"):
        admission.refused(engine)
    assert dict(admission.refusals()) == {"a": 2, "b": 1}
    assert dict(admission.refusals()) == {}


def test_credits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Admission[int](shed_saves=True, save_credits=0)
