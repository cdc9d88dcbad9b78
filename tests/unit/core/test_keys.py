"""Store keys in the vLLM MooncakeStoreConnector format."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.keys import (
    RUN_BLOCKS,
    KeySpeller,
    ValueFormat,
    key_prefix,
    keys_for,
    layout_keys,
    parse_key,
    store_key,
)
from pipeline.core.layout import KVCacheLayout

HASH = bytes(range(32))


def test_store_key_format_without_prefix() -> None:
    """A key is model@tp_rank:T@pcpP@dcpD@pp_rank:Q@group:G@hex with no namespace."""
    key = store_key("Qwen/Qwen3-Next", HASH, store_group=1, tp_rank=2, pcp_rank=3,
                    dcp_rank=4, pp_rank=5)
    assert key == f"Qwen/Qwen3-Next@tp_rank:2@pcp3@dcp4@pp_rank:5@group:1@{HASH.hex()}"


def test_store_key_format_with_cache_prefix() -> None:
    """A cache_prefix namespace is prepended with '@'."""
    key = store_key("m", HASH, store_group=0, cache_prefix="prod")
    assert key == f"prod@m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH.hex()}"


names = st.text(st.characters(blacklist_characters="@", blacklist_categories=("Cs",)),
                min_size=1, max_size=12)


@given(names, st.binary(min_size=32, max_size=32), st.integers(0, 7),
       st.tuples(*(st.integers(0, 64) for _ in range(4))), st.just("") | names)
def test_store_key_is_prefix_at_hex(
    model: str, digest: bytes, group: int, ranks: tuple[int, int, int, int], prefix: str
) -> None:
    """Every key is its key_prefix, '@' and the lowercase hex digest, parseable back."""
    tp, pcp, dcp, pp = ranks
    kwargs = dict(store_group=group, tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp,
                  cache_prefix=prefix)
    key = store_key(model, digest, **kwargs)  # type: ignore[arg-type]
    assert key == key_prefix(model, **kwargs) + "@" + digest.hex()  # type: ignore[arg-type]
    fields = key.split("@")
    if prefix:
        assert fields.pop(0) == prefix
    assert fields == [model, f"tp_rank:{tp}", f"pcp{pcp}", f"dcp{dcp}", f"pp_rank:{pp}",
                      f"group:{group}", digest.hex()]
    assert re.fullmatch(r"[0-9a-f]{64}", fields[-1])


QSA = [
    {"kind": "full_attention", "block_size": 800},
    {"kind": "circular_buffer", "block_size": 8},
    {"kind": "mamba", "block_size": 800, "mamba_cache_mode": "align"},
]


def test_vllm_format_key_prefixes_use_store_indices() -> None:
    """vllm-format prefixes are numbered by store-group index; the ring gets none."""
    lay = KVCacheLayout.from_dict({
        "model": "qwen3-next", "tp_rank": 1, "tp_size": 2, "cache_prefix": "ns", "groups": QSA,
    })
    own = tuple(g.own for g in layout_keys(lay, ValueFormat.VLLM))
    assert own == (
        "ns@qwen3-next@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0",
        "ns@qwen3-next@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1",
    )
    assert own[1] + "@" + HASH.hex() == store_key(
        "qwen3-next", HASH, store_group=lay.store_group_index(2) or 0, tp_rank=1,
        cache_prefix="ns",
    )


def test_vllm_format_divides_the_tp_rank_by_the_replication_factor() -> None:
    """GQA with fewer KV heads than ranks shares keys between ranks of one head; a Mamba
    group never does; a lookup requires each distinct shard, for every pp rank."""
    lay = KVCacheLayout.from_dict({
        "model": "m", "tp_rank": 3, "tp_size": 4, "pp_size": 2, "num_kv_heads": 2,
        "store_namespace": "@store_pp:2@store_format:x", "groups": QSA,
    })
    full, mamba = layout_keys(lay, ValueFormat.VLLM)
    assert full.own == "m@store_pp:2@store_format:x@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0"
    assert mamba.own == "m@store_pp:2@store_format:x@tp_rank:3@pcp0@dcp0@pp_rank:0@group:1"
    assert sorted(p.split("@", 3)[3] for p in full.lookup) == [
        f"tp_rank:{tp}@pcp0@dcp0@pp_rank:{pp}@group:0" for tp in (0, 1) for pp in (0, 1)
    ]
    assert len(mamba.lookup) == 8


def test_native_format_keys_live_in_a_namespace_vllm_never_reads() -> None:
    """Native keys carry kvsidecar's namespace with the geometry, alike on every rank."""
    rank0, rank1 = (KVCacheLayout.from_dict({"model": "m", "tp_rank": r, "tp_size": 2,
                                             "groups": QSA}) for r in (0, 1))
    native0, native1 = layout_keys(rank0, ValueFormat.NATIVE)[0], layout_keys(
        rank1, ValueFormat.NATIVE)[0]
    assert native0.own.startswith("m@store_format:kvsidecar_native_")
    assert native0.own != layout_keys(rank0, ValueFormat.VLLM)[0].own
    assert native0.lookup == native1.lookup and native1.own in native0.lookup


def test_parse_key_reads_the_group_and_hash_back() -> None:
    """parse_key inverts the last two parts of any key; other strings give None."""
    key = store_key("m", HASH, store_group=3, namespace="@store_format:x", tp_rank=1)
    assert parse_key(key) == (3, HASH)
    assert parse_key("not-a-key") is None


block_hash = st.binary(min_size=32, max_size=32)


@given(st.lists(st.tuples(st.sampled_from(["m@group:0", "m@group:1", "other"]),
                          st.lists(st.sampled_from([bytes([b]) * 32 for b in range(12)])
                                   | block_hash, max_size=3 * RUN_BLOCKS),
                          st.booleans()),
                max_size=12),
       st.integers(1, 40))
def test_a_speller_spells_as_keys_for_whatever_it_remembers(
    calls: list[tuple[str, list[bytes], bool]], capacity: int,
) -> None:
    """Whatever was asked before, and however few keys it may remember, a speller's keys
    are ``keys_for``'s: all new, all remembered, some of each, or (``run_keys``) a run
    remembered whole (runs with the same last hash and length but other hashes before
    it among them); it never holds more than its capacity, whatever one call asks."""
    speller = KeySpeller(capacity)
    for prefix, hashes, as_run in calls:
        spell = speller.run_keys if as_run else speller.keys
        assert spell(prefix, hashes) == keys_for(prefix, hashes) == [
            f"{prefix}@{h.hex()}" for h in hashes]
        assert len(speller) <= capacity


def test_a_remembered_key_is_the_same_string() -> None:
    """Asked again, even with equal hashes in new objects, the keys are the very strings
    spelled the first time (their string hash already computed)."""
    speller = KeySpeller()
    hashes = [bytes([b]) * 32 for b in range(40, 48)]
    first = speller.keys("m@group:7", hashes)
    again = speller.keys("m@group:7", [bytes(bytearray(h)) for h in hashes])
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert len(speller) == len(hashes)


def test_a_run_asked_again_is_found_whole_and_only_when_every_hash_matches() -> None:
    """A run of RUN_BLOCKS hashes or more (``run_keys``), asked again with equal hashes
    in new objects, gets the keys spelled the first time without a probe of the
    speller's dictionary; one hash changed before the last, and it is spelled afresh,
    correctly."""
    speller = KeySpeller()
    hashes = [bytes([b]) * 32 for b in range(RUN_BLOCKS * 2)]
    first = speller.run_keys("m@group:0", hashes)
    speller._spelled.clear()  # a probe would now find nothing and spell new strings
    again = speller.run_keys("m@group:0", [bytes(bytearray(h)) for h in hashes])
    assert again == first and all(a is b for a, b in zip(first, again, strict=True))
    changed = [*hashes[:3], b"\xff" * 32, *hashes[4:]]
    assert speller.run_keys("m@group:0", changed) == keys_for("m@group:0", changed)
    assert speller.run_keys("m@group:1", hashes) == keys_for("m@group:1", hashes)
