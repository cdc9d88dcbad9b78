"""Chained block hashes, extra keys, incremental hashing and the coarse per-group view."""

from __future__ import annotations

import array
import hashlib
from typing import Any

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core._blockhash import chain
from pipeline.core.hashing import (
    DEFAULT_SEED,
    RequestHasher,
    block_hashes,
    group_block_hashes,
    none_hash,
    sha256_cbor,
)


def reference(parent: bytes, tokens: list[int], extra: Any = None) -> bytes:
    """One chained block hash written out from the contract (ARCHITECTURE §3)."""
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra), canonical=True)).digest()


def reference_chain(tokens: list[int], size: int, parent: bytes | None = None) -> list[bytes]:
    """Every full block's hash, each chained from the one before (the first from
    ``parent``, NONE_HASH by default), written out from the contract."""
    hashes = []
    parent = none_hash() if parent is None else parent
    for start in range(0, len(tokens) - size + 1, size):
        parent = reference(parent, tokens[start : start + size])
        hashes.append(parent)
    return hashes


tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=120)
block_st = st.integers(1, 17)
# Every width a CBOR unsigned integer takes, at its edges.
uint32_st = st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]) | st.integers(
    0, 2**32 - 1)


def test_none_hash_is_sha256_cbor_of_the_seed() -> None:
    """NONE_HASH is sha256 of the CBOR of 'vllm-none-hash', or of the given seed string."""
    expected = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    assert none_hash() == expected == none_hash(DEFAULT_SEED)
    assert none_hash("42") == sha256_cbor("42") != expected


@given(tokens_st, block_st)
def test_block_hashes_chain_over_full_blocks(tokens: list[int], size: int) -> None:
    """h_i = sha256(cbor(h_{i-1}, tokens_i, None)) from NONE_HASH, full blocks only."""
    expected = reference_chain(tokens, size)
    assert block_hashes(tokens, size) == expected
    assert len(expected) == len(tokens) // size


@given(tokens_st, block_st, st.text(min_size=1, max_size=8))
def test_seed_changes_only_the_root(tokens: list[int], size: int, seed: str) -> None:
    """A seed replaces NONE_HASH as the first block's parent and nothing else."""
    hashes = block_hashes(tokens, size, seed=seed)
    if hashes:
        assert hashes[0] == reference(none_hash(seed), tokens[:size])


def test_hashes_depend_on_every_earlier_block() -> None:
    """Changing a token in block 0 changes every later block hash."""
    a = block_hashes(list(range(64)), 16)
    b = block_hashes([1, *range(1, 64)], 16)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_lora_key_is_in_every_block() -> None:
    """A LoRA request adds ("lora", name, path) to every block's extra keys."""
    tokens = list(range(32))
    hashes = block_hashes(tokens, 16, lora_name="ad", lora_path="/w/ad")
    h0 = reference(none_hash(), tokens[:16], (("lora", "ad", "/w/ad"),))
    assert hashes == [h0, reference(h0, tokens[16:], (("lora", "ad", "/w/ad"),))]


def test_lora_without_path_hashes_empty_path() -> None:
    """A LoRA name without a path hashes the path as '' (vLLM LoRARequest's field default)."""
    tokens = list(range(16))
    assert block_hashes(tokens, 16, lora_name="ad") == [
        reference(none_hash(), tokens, (("lora", "ad", ""),))
    ]


def test_empty_lora_name_still_is_a_lora_request() -> None:
    """An empty LoRA name is still a LoRA request and gets a lora key."""
    tokens = list(range(16))
    assert block_hashes(tokens, 16, lora_name="", lora_path="/p") == [
        reference(none_hash(), tokens, (("lora", "", "/p"),))
    ]


def test_cache_salt_only_in_block_zero() -> None:
    """cache_salt enters block 0's extra keys only."""
    tokens = list(range(32))
    h0 = reference(none_hash(), tokens[:16], (("cache_salt", "tenant"),))
    assert block_hashes(tokens, 16, cache_salt="tenant") == [h0, reference(h0, tokens[16:])]


def test_empty_cache_salt_is_no_salt() -> None:
    """An empty cache salt hashes like no salt at all."""
    assert block_hashes(list(range(32)), 16, cache_salt="") == block_hashes(list(range(32)), 16)


def test_extra_keys_order_is_lora_mm_salt() -> None:
    """Extra keys are ordered LoRA, then multimodal items, then the salt."""
    tokens = list(range(16))
    got = block_hashes(tokens, 16, lora_name="l", lora_path="p", cache_salt="s",
                       mm_items=[("img", 2, 3)])
    extra = (("lora", "l", "p"), ("mm", "img", 2), ("cache_salt", "s"))
    assert got == [reference(none_hash(), tokens, extra)]


def test_mm_item_appears_in_every_overlapping_block_with_relative_offset() -> None:
    """An item spanning blocks is keyed in each with its offset from that block's start."""
    tokens = list(range(48))
    # img0 covers tokens 4..19 (blocks 0 and 1), img1 covers 20..21 (block 1), none in block 2.
    got = block_hashes(tokens, 16, mm_items=[("img1", 20, 2), ("img0", 4, 16)])
    h0 = reference(none_hash(), tokens[:16], (("mm", "img0", 4),))
    h1 = reference(h0, tokens[16:32], (("mm", "img0", -12), ("mm", "img1", 4)))
    assert got == [h0, h1, reference(h1, tokens[32:])]


@st.composite
def mm_items_st(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """Placeholder ranges never overlap (an engine assumes so), sorted by offset."""
    items = []
    position = 0
    for _ in range(draw(st.integers(0, 4))):
        position += draw(st.integers(0, 20))
        length = draw(st.integers(1, 30))
        items.append((draw(st.sampled_from(["a", "b", "c"])), position, length))
        position += length
    return items


extras_st = st.fixed_dictionaries(
    {},
    optional={
        "lora_name": st.sampled_from(["", "ad"]),
        "lora_path": st.sampled_from(["", "/w"]),
        "cache_salt": st.sampled_from(["", "s"]),
        "mm_items": mm_items_st(),
        "seed": st.sampled_from(["0", "1234"]),
    },
)


@given(tokens_st, block_st, extras_st, st.lists(st.integers(0, 120), max_size=6))
def test_incremental_hashing_equals_one_shot_for_any_split(
    tokens: list[int], size: int, extras: dict[str, Any], cuts: list[int]
) -> None:
    """RequestHasher.extend over any growing prefixes ends with the one-shot hashes."""
    hasher = RequestHasher(size, **extras)
    for cut in sorted(cuts):
        got = hasher.extend(tokens[:cut])
        assert got == block_hashes(tokens[:cut], size, **extras)
    assert hasher.extend(tokens) == block_hashes(tokens, size, **extras)
    assert hasher.hashes == block_hashes(tokens, size, **extras)


@given(tokens_st, block_st, mm_items_st())
def test_mm_keys_match_overlap_definition(
    tokens: list[int], size: int, items: list[tuple[str, int, int]]
) -> None:
    """Each block carries ("mm", id, offset - start) for every item overlapping it, in order."""
    parent = none_hash()
    expected = []
    for start in range(0, len(tokens) - size + 1, size):
        end = start + size
        keys = tuple(("mm", ident, off - start) for ident, off, n in items
                     if off < end and off + n > start)
        parent = reference(parent, tokens[start:end], keys or None)
        expected.append(parent)
    assert block_hashes(tokens, size, mm_items=items) == expected


def test_hash_block_size_must_be_positive() -> None:
    """A non-positive hash block size is refused."""
    with pytest.raises(ValueError, match="hash_block_size must be positive"):
        RequestHasher(0)


@given(st.integers(0, 40), st.integers(1, 8), st.integers(1, 6))
def test_group_view_takes_the_hash_at_each_block_end(n: int, hbs: int, k: int) -> None:
    """Coarse block j of a k-times larger group is fine hash h[(j+1)*k - 1]."""
    fine = [bytes([i]) * 32 for i in range(n)]
    coarse = group_block_hashes(fine, hbs, k * hbs)
    assert coarse == [fine[(j + 1) * k - 1] for j in range(n // k)]


def test_group_view_same_size_is_identity() -> None:
    """A group hashing at hash_block_size uses the fine hashes unchanged."""
    fine = block_hashes(list(range(64)), 16)
    assert group_block_hashes(fine, 16, 16) == fine


def test_group_view_rejects_non_multiple() -> None:
    """A group block size that is not a multiple of hash_block_size is refused."""
    with pytest.raises(ValueError, match="not a multiple of hash_block_size 16"):
        group_block_hashes([], 16, 24)


@given(st.binary(max_size=40), st.lists(uint32_st, max_size=80),
       st.sampled_from([1, 2, 16, 23, 24, 25]))
def test_the_native_chain_spells_every_width_as_cbor_does(
    parent: bytes, tokens: list[int], size: int,
) -> None:
    """``_blockhash.chain`` hashes each full block exactly as the contract's Python
    spelling does: any parent length, token ids of every CBOR width, array heads short
    and long."""
    assert chain(parent, array.array("I", tokens), size) == reference_chain(tokens, size, parent)


def test_the_native_chain_refuses_what_is_not_whole_blocks_of_uint32() -> None:
    """A block size below 1, or bytes that are not whole uint32s: a ValueError."""
    with pytest.raises(ValueError, match="block_size must be positive"):
        chain(none_hash(), array.array("I", [1, 2]), 0)
    with pytest.raises(ValueError, match="6 bytes of tokens"):
        chain(none_hash(), b"\0" * 6, 1)


@pytest.mark.parametrize("size", [255, 256, 300])
def test_blocks_longer_than_a_one_byte_array_head_hash_alike(size: int) -> None:
    """Blocks of 256 tokens and more take a two-byte array head."""
    tokens = list(range(70_000, 70_000 + 3 * size))
    assert block_hashes(tokens, size) == reference_chain(tokens, size)


@given(st.lists(st.integers(-(2**40), 2**40), max_size=40), block_st)
def test_token_ids_beyond_uint32_are_hashed_in_python_alike(
    tokens: list[int], size: int,
) -> None:
    """A token id the native chain cannot take (negative, or past uint32) leaves the
    request to the Python spelling, with the same bytes as the contract."""
    assert block_hashes(tokens, size) == reference_chain(tokens, size)


@given(st.lists(uint32_st, max_size=120), block_st, st.lists(st.integers(0, 120), max_size=4))
def test_token_ids_as_received_hash_as_a_list_does(
    tokens: list[int], size: int, cuts: list[int],
) -> None:
    """Token ids as the sidecar receives them (``array('I')``), extended a prefix at a
    time, hash exactly as the same ids in a list."""
    hasher = RequestHasher(size)
    received = array.array("I", tokens)
    for cut in sorted(cuts):
        assert hasher.extend(received[:cut]) == block_hashes(tokens[:cut], size)
    assert hasher.extend(received) == block_hashes(tokens, size)
