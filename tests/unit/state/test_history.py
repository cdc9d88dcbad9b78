"""The block history: what it says of a block absent from the store, and its bound."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.messages import RequestKeys, pack_tokens
from pipeline.core.outcomes import PRESENT, STORE_FULL, STORED, KeyOutcome, failed
from pipeline.core.store import Presence
from pipeline.state.history import BlockHistory, Prompt, Verdict, _Bounded, content_prints

NO_KEYS = RequestKeys()
SALTED = RequestKeys(cache_salt="tenant")


def why(history: BlockHistory, key: str, *, presence: Presence = Presence.ABSENT,
        prefix: str = "p", block: tuple[int, bytes] = (0, b"h"), prompt: Prompt | None = None,
        end: int = 0, keys: RequestKeys = NO_KEYS) -> Verdict:
    return history.why(key, prefix, block, presence, keys, prompt, end)[0]


def prompt(tokens: list[int], block: int = 16) -> Prompt:
    """A prompt as explained: its tokens and their prints at each block's end."""
    packed = pack_tokens(tokens)
    ends = list(range(block, len(tokens) + 1, block))
    return Prompt(packed, content_prints(packed, ends), block)


def test_the_store_says_first_what_is_present_or_unusable() -> None:
    """A present key is present whatever the record says; a foreign value is unusable."""
    history = BlockHistory(8)
    history.saved([("p@h", "p", (0, b"h"), STORE_FULL, None)], NO_KEYS)
    assert why(history, "p@h", presence=Presence.PRESENT) is Verdict.PRESENT
    assert history.why("p@h", "p", (0, b"h"), Presence.FOREIGN, NO_KEYS)[:2] == (
        Verdict.UNUSABLE, "foreign_value")


def test_a_block_stored_then_gone_is_evicted_and_a_later_skip_does_not_hide_it() -> None:
    """Stored, then absent: evicted (with the reason when the eviction was seen); a skip
    of the same key afterwards leaves the record as it was."""
    history = BlockHistory(8)
    history.saved([("p@h", "p", (0, b"h"), STORED, None)], NO_KEYS)
    history.saved([("p@h", "p", (0, b"h"), STORE_FULL, None)], NO_KEYS)
    assert history.why("p@h", "p", (0, b"h"), Presence.ABSENT, NO_KEYS)[:2] == (
        Verdict.EVICTED, "stored, since gone from the store")
    history.evicted(["p@h", "p@unknown"])
    verdict, reason, age_s = history.why("p@h", "p", (0, b"h"), Presence.ABSENT, NO_KEYS)
    assert (verdict, reason) == (Verdict.EVICTED, "evicted to make room") and age_s >= 0
    assert why(history, "p@unknown") is Verdict.NEVER_STORED  # an eviction names no new key


def test_skips_failures_and_corrupt_loads_keep_their_reason() -> None:
    """A skipped block says why, a failed one too; a load that found the value corrupt
    marks it failed_integrity."""
    history = BlockHistory(8)
    history.saved([("p@a", "p", (0, b"a"), STORE_FULL, None)], NO_KEYS)
    history.saved([("p@b", "p", (0, b"b"), failed("store: down"), None)], NO_KEYS)
    history.saved([("p@c", "p", (0, b"c"), PRESENT, None)], NO_KEYS)
    history.load_failed("p@c", KeyOutcome(STORE_FULL.status, "checksum_mismatch"))
    assert history.why("p@a", "p", (0, b"a"), Presence.ABSENT, NO_KEYS)[:2] == (
        Verdict.SKIPPED, "store_full")
    assert history.why("p@b", "p", (0, b"b"), Presence.ABSENT, NO_KEYS)[:2] == (
        Verdict.FAILED, "store: down")
    assert why(history, "p@c", block=(0, b"c")) is Verdict.FAILED_INTEGRITY


def test_the_same_block_or_tokens_under_another_name_are_found() -> None:
    """A block hash stored under another prefix (same store group) is in another
    namespace; the same tokens saved with another salt are under other keys."""
    history = BlockHistory(8)
    asked = prompt(list(range(32)))
    history.saved([("q@h", "q", (0, b"h"), STORED, asked.prints[16])], SALTED)
    assert why(history, "p@h", block=(0, b"h")) is Verdict.OTHER_NAMESPACE
    assert why(history, "p@h", block=(1, b"h")) is Verdict.NEVER_STORED  # another group
    verdict, reason, _ = history.why("p@x", "p", (0, b"x"), Presence.ABSENT, NO_KEYS,
                                     asked, 16)
    assert verdict is Verdict.OTHER_KEYS and "cache salt" in reason
    assert why(history, "p@x", block=(0, b"x"), prompt=asked, end=16, keys=SALTED) is (
        Verdict.NEVER_STORED)  # the same keys: nothing to say


def test_a_refused_save_is_known_by_its_tokens_and_kept_apart() -> None:
    """A save refused before hashing explains the blocks of a prompt it covered (under
    the same keys only); a flood of refusals keeps its own bound and never pushes the
    blocks' own records out."""
    history = BlockHistory(16)
    refused = prompt(list(range(48)))
    overloaded = KeyOutcome(STORE_FULL.status, "overloaded")
    history.saved([("p@kept", "p", (0, b"kept"), STORE_FULL, None)], NO_KEYS)
    history.refused(refused.prints[16], refused.tokens, overloaded, NO_KEYS)
    longer = prompt(list(range(64)))  # the refused prompt, and 16 tokens more
    verdict, reason, age_s = history.why("p@y", "p", (0, b"y"), Presence.ABSENT, NO_KEYS,
                                         longer, 48)
    assert (verdict, reason) == (Verdict.SKIPPED, "overloaded (the save was refused)")
    assert age_s >= 0
    assert why(history, "p@z", prompt=longer, end=64) is Verdict.NEVER_STORED  # not covered
    assert why(history, "p@y", prompt=longer, end=48, keys=SALTED) is Verdict.NEVER_STORED
    other = prompt(list(range(16)) + [9] * 48)  # the same first block, then other tokens
    assert why(history, "p@w", prompt=other, end=32) is Verdict.NEVER_STORED
    for start in range(100):  # a flood of other refused prompts
        flood = prompt(list(range(start + 1, start + 17)))
        history.refused(flood.prints[16], flood.tokens, overloaded, NO_KEYS)
    assert why(history, "p@kept", block=(0, b"kept")) is Verdict.SKIPPED
    assert why(history, "p@y", prompt=longer, end=48) is Verdict.NEVER_STORED


def test_content_prints_depend_on_the_tokens_up_to_each_end_only() -> None:
    """Prints of a prefix agree between prompts that share it and differ after."""
    a = content_prints(pack_tokens([1, 2, 3, 4, 5, 6]), [2, 4, 6])
    b = content_prints(pack_tokens([1, 2, 3, 4, 9, 9]), [4, 6])
    assert a[4] == b[4] and a[6] != b[6] and a[2] != a[4]


def test_nothing_recorded_is_in_the_cycle_collectors_sight() -> None:
    """Under load every index is rewritten between two collections: a tracked record
    would be walked by each young collection, so none may be one."""
    history = BlockHistory(8)
    history.saved([("p@a", "p", (0, b"a"), STORED, 1),
                   ("p@b", "p", (1, b"b"), STORE_FULL, None)], SALTED)
    history.load_failed("p@c", failed("checksum"))
    history.evicted(["p@a"])
    recorded = [item for index in (history._keys, history._prefixes, history._contents)
                for entry in index.items() for item in entry]
    assert len(recorded) == 2 * (3 + 1 + 1)
    assert not [item for item in recorded if gc.is_tracked(item)]
    assert why(history, "p@a", block=(0, b"a")) is Verdict.EVICTED
    assert why(history, "p@x", block=(0, b"a"), prefix="q") is Verdict.OTHER_NAMESPACE


def test_the_history_forgets_its_oldest_blocks_past_its_bound() -> None:
    """Past max_blocks the oldest records go (never_stored again); 0 turns it off."""
    history = BlockHistory(2)
    for name in ("a", "b", "c"):
        history.saved([(f"p@{name}", "p", (0, name.encode()), STORE_FULL, None)], NO_KEYS)
    assert why(history, "p@a", block=(0, b"a")) is Verdict.NEVER_STORED
    assert why(history, "p@c", block=(0, b"c")) is Verdict.SKIPPED
    assert not BlockHistory(0).enabled


def test_a_save_of_more_blocks_than_the_bound_keeps_its_last_blocks() -> None:
    """Blocks of one save are recorded in order: past the bound its first ones go."""
    history = BlockHistory(2)
    history.saved([(f"p@{name}", "p", (0, name.encode()), STORE_FULL, None)
                   for name in ("a", "b", "c")], NO_KEYS)
    assert why(history, "p@a", block=(0, b"a")) is Verdict.NEVER_STORED
    assert why(history, "p@b", block=(0, b"b")) is Verdict.SKIPPED
    assert why(history, "p@c", block=(0, b"c")) is Verdict.SKIPPED


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(0, 6),
       batches=st.lists(st.lists(st.tuples(st.integers(0, 9), st.integers()), max_size=8),
                        max_size=6))
def test_a_bounded_record_keeps_the_most_recently_written_entries(
    limit: int, batches: list[list[tuple[int, int]]],
) -> None:
    """Written in batches or one at a time, a record keeps the ``limit`` most recently
    written keys, oldest first, each with its last value."""
    at_once: _Bounded[int, int] = _Bounded(limit)
    one_by_one: _Bounded[int, int] = _Bounded(limit)
    written: list[tuple[int, int]] = []  # every write, in order
    for batch in batches:
        at_once.put_all(batch)
        for key, value in batch:
            one_by_one.put(key, value)
        written.extend(batch)
        latest = {key: (at, value) for at, (key, value) in enumerate(written)}
        newest = sorted(latest.items(), key=lambda item: item[1][0])[-limit:] if limit else []
        expected = [(key, value) for key, (_, value) in newest]
        assert list(at_once.items()) == expected
        assert list(one_by_one.items()) == expected
