"""The hybrid hit rule: where a request may resume from the store (ARCHITECTURE §5)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.hitrule import longest_hit, max_hit_tokens, required_blocks
from pipeline.core.layout import KVCacheGroup, KVCacheLayout

# -- helpers -------------------------------------------------------------------------------


def full(block_size: int) -> dict[str, Any]:
    return {"kind": "full_attention", "block_size": block_size}


def swa(block_size: int, window: int) -> dict[str, Any]:
    return {"kind": "sliding_window", "block_size": block_size, "sliding_window": window}


def mamba(block_size: int) -> dict[str, Any]:
    return {"kind": "mamba", "block_size": block_size, "mamba_cache_mode": "align"}


def ring(capacity: int) -> dict[str, Any]:
    return {"kind": "circular_buffer", "block_size": capacity}


def layout(*groups: dict[str, Any]) -> KVCacheLayout:
    built = KVCacheLayout.from_dict({"groups": list(groups)})
    built.validate_for_store()
    return built


def group(spec: dict[str, Any]) -> KVCacheGroup:
    return layout(spec).groups[0]


def available_set(pairs: set[tuple[int, int]]) -> Any:
    return lambda g, b: (g, b) in pairs


def all_blocks(store_groups: int, blocks: int) -> set[tuple[int, int]]:
    return {(g, b) for g in range(store_groups) for b in range(blocks)}


# -- required_blocks -------------------------------------------------------------------------


def test_full_attention_needs_every_block_before_p() -> None:
    """A full-attention group resumes at P only with blocks [0, P / block_size)."""
    assert required_blocks(group(full(4)), 12) == range(0, 3)


def test_sliding_window_needs_only_the_window_before_p() -> None:
    """A sliding-window group needs the blocks covering the window - 1 tokens before P."""
    g = group(swa(4, 5))  # P attends 4 tokens back: exactly one block
    assert required_blocks(g, 16) == range(3, 4)
    g = group(swa(4, 6))  # 5 tokens back: two blocks
    assert required_blocks(g, 16) == range(2, 4)


def test_sliding_window_longer_than_p_needs_the_whole_prefix() -> None:
    """A window reaching before token 0 needs every block from the start."""
    assert required_blocks(group(swa(4, 100)), 8) == range(0, 2)


def test_mamba_needs_only_the_state_block_ending_at_p() -> None:
    """A mamba (align) group resumes from the single state block that ends at P."""
    assert required_blocks(group(mamba(4)), 12) == range(2, 3)


@pytest.mark.parametrize("spec", [full(4), swa(4, 8), mamba(4)])
def test_unaligned_p_cannot_resume(spec: dict[str, Any]) -> None:
    """No group resumes in the middle of one of its blocks."""
    assert required_blocks(group(spec), 6) is None


@pytest.mark.parametrize("spec", [full(4), swa(4, 8), mamba(4)])
def test_zero_tokens_needs_nothing(spec: dict[str, Any]) -> None:
    """Resuming at token 0 needs no block from any group."""
    assert required_blocks(group(spec), 0) == range(0)


# -- max_hit_tokens --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(0, 0), (1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (16, 12), (17, 16)],
)
def test_max_hit_always_leaves_the_last_token_to_recompute(num_tokens: int, expected: int) -> None:
    """A hit is at most num_tokens - 1, aligned down: a full hit never covers the last token."""
    assert max_hit_tokens(layout(full(4)), num_tokens) == expected


def test_max_hit_aligns_to_the_lcm_of_stored_block_sizes() -> None:
    """With block sizes 4 and 6 the alignment is 12, and the ring does not count."""
    lay = layout(full(4), ring(5), swa(6, 8))
    assert lay.lookup_alignment == 12
    assert max_hit_tokens(lay, 24) == 12
    assert max_hit_tokens(lay, 25) == 24


def test_max_hit_aligns_to_hash_block_size_when_mamba_blocks_are_larger() -> None:
    """A mamba-align group larger than hash_block_size aligns lookups to hash_block_size."""
    lay = layout(full(4), mamba(8))
    assert lay.hash_block_size == 4
    assert lay.lookup_alignment == 4
    assert max_hit_tokens(lay, 11) == 8


# -- longest_hit ----------------------------------------------------------------------------


def test_full_attention_hit_stops_at_the_first_missing_block() -> None:
    """A gap in a full-attention group ends the hit there, whatever follows it."""
    lay = layout(full(4))
    have = {(0, 0), (0, 1), (0, 3), (0, 4)}
    assert longest_hit(lay, 20, available_set(have)) == 8


def test_hit_is_capped_by_max_tokens() -> None:
    """Blocks beyond max_tokens never extend a hit."""
    lay = layout(full(4))
    assert longest_hit(lay, 10, available_set(all_blocks(1, 10))) == 8


def test_sliding_window_hits_with_a_hole_before_the_window() -> None:
    """A sliding-window group resumes at P with a gap that lies outside the window."""
    lay = layout(swa(4, 5))
    have = {(0, 3)}  # only the block right before P = 16
    assert longest_hit(lay, 16, available_set(have)) == 16


def test_mamba_hits_with_only_the_state_block_at_p() -> None:
    """A mamba group resumes at P from the one block ending at P, earlier ones absent."""
    lay = layout(mamba(4))
    assert longest_hit(lay, 16, available_set({(0, 2)})) == 12


def test_hybrid_hit_needs_every_stored_group_and_ignores_the_ring() -> None:
    """full + ring + mamba: P needs the full prefix and the mamba block ending at P."""
    lay = layout(full(4), ring(4), mamba(4))
    assert lay.prefix_cacheable_group_ids == (0, 2)
    have = {(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 3)}
    # Full attention reaches 16 and mamba has states at 8 and 16: the hit is 16.
    assert longest_hit(lay, 16, available_set(have)) == 16
    have.discard((1, 3))
    assert longest_hit(lay, 16, available_set(have)) == 8
    have.discard((0, 1))
    assert longest_hit(lay, 16, available_set(have)) == 0


def test_mamba_larger_than_hash_block_lands_only_on_its_own_boundaries() -> None:
    """full(4) + mamba(8): a hit at 12 is aligned for full attention but not for mamba."""
    lay = layout(full(4), mamba(8))
    have = all_blocks(2, 4)
    assert longest_hit(lay, 12, available_set(have)) == 8


def test_no_blocks_means_no_hit() -> None:
    """With nothing available the hit is 0."""
    assert longest_hit(layout(full(4), mamba(4)), 64, lambda g, b: False) == 0


# -- the property: longest_hit equals a brute-force reference ---------------------------------


def reference_hit(lay: KVCacheLayout, max_tokens: int, have: set[tuple[int, int]]) -> int:
    """Try every aligned P from the top; check each group's token coverage from scratch."""
    align = lay.lookup_alignment
    for p in range(max_tokens - max_tokens % align, 0, -align):
        if all(_group_ok(g, p, index, have) for index, g in enumerate(lay.store_groups)):
            return p
    return 0


def _group_ok(g: KVCacheGroup, p: int, index: int, have: set[tuple[int, int]]) -> bool:
    size = g.block_size
    if p % size:
        return False
    blocks = range(p // size)
    if g.kind == "mamba":
        needed = [p // size - 1]
    elif g.kind == "sliding_window":
        assert g.sliding_window is not None
        first = max(0, p - g.sliding_window + 1)
        needed = [b for b in blocks if (b + 1) * size > first]
    else:
        needed = list(blocks)
    return all((index, b) in have for b in needed)


@st.composite
def hybrid_layouts(draw: st.DrawFn) -> KVCacheLayout:
    base = draw(st.sampled_from([1, 2, 4]))
    size = st.sampled_from([1, 2, 3, 4]).map(lambda k: k * base)
    stored = st.one_of(
        size.map(full),
        st.builds(swa, size, st.integers(1, 24)),
        size.map(mamba),
    )
    groups = draw(st.lists(stored, min_size=1, max_size=3))
    for _ in range(draw(st.integers(0, 1))):
        groups.insert(draw(st.integers(0, len(groups))), ring(draw(st.sampled_from([4, 8]))))
    return layout(*groups)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), lay=hybrid_layouts(), max_tokens=st.integers(0, 48))
def test_longest_hit_matches_brute_force(
    data: st.DataObject, lay: KVCacheLayout, max_tokens: int
) -> None:
    """For random hybrid layouts and availability sets, longest_hit equals the reference."""
    groups = len(lay.store_groups)
    # A per-test density gives both sparse sets and long unbroken prefixes.
    density = data.draw(st.sampled_from([1.0, 0.95, 0.8]) | st.floats(0.0, 1.0), label="density")
    have = {
        (g, b)
        for g in range(groups)
        for b in range(max_tokens + 1)
        if data.draw(st.floats(0.0, 1.0)) < density
    }
    expected = reference_hit(lay, max_tokens, have)
    assert longest_hit(lay, max_tokens, available_set(have)) == expected
