"""KVCacheLayout: group projections, store-group remapping and store validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.layout import GroupKind, KVCacheLayout, LayoutError

# -- helpers -------------------------------------------------------------------------------


def full(block_size: int = 16, **extra: Any) -> dict[str, Any]:
    return {"kind": "full_attention", "block_size": block_size, **extra}


def ring(capacity: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "circular_buffer", "block_size": capacity, **extra}


def mamba(block_size: int, mode: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "mamba", "block_size": block_size, "mamba_cache_mode": mode, **extra}


def swa(block_size: int, window: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "sliding_window", "block_size": block_size, "sliding_window": window,
            **extra}


def layout(*groups: dict[str, Any], **fields: Any) -> KVCacheLayout:
    return KVCacheLayout.from_dict({"groups": list(groups), **fields})


def qwen3_next(ring_capacity: int = 8, mamba_mode: str = "align", **fields: Any) -> KVCacheLayout:
    return layout(
        full(800, layers=["model.layers.3.self_attn.attn"]),
        ring(ring_capacity, layers=["model.layers.3.self_attn.qsa_ring"]),
        mamba(800, mamba_mode, layers=["model.layers.0.linear_attn"]),
        **fields,
    )


# -- the seed regression ---------------------------------------------------------------------


def test_seed_qwen3_next_hybrid_ring_is_not_stored_and_mamba_align_passes() -> None:
    """full(800) + ring(8) + mamba(800, align) stores groups 0 and 2 as store groups 0 and 1."""
    lay = qwen3_next()
    assert lay.transfer_group_ids == (0, 1, 2)
    assert lay.prefix_cacheable_group_ids == (0, 2)
    assert [lay.store_group_index(g) for g in range(3)] == [0, None, 1]
    assert lay.project_block_ids(([10], [80], [30])) == ([10], [30])
    assert lay.project_transfer_all(([10], [80], [30])) == ([10], [80], [30])
    lay.validate_for_store()
    assert lay.hash_block_size == 800
    assert lay.payload_layers == (
        ("model.layers.3.self_attn.attn",), ("model.layers.0.linear_attn",),
    )
    assert not any("qsa_ring" in name for names in lay.payload_layers for name in names)


def test_seed_qwen3_next_hybrid_mamba_none_fails_naming_group_and_mode() -> None:
    """The same layout with mamba_cache_mode 'none' is refused, naming group 2 and the mode."""
    with pytest.raises(LayoutError, match=r"group 2: mamba_cache_mode='none' != 'align'"):
        qwen3_next(mamba_mode="none").validate_for_store()


def test_seed_qwen3_next_hybrid_rewritten_engine_block_size_is_ignored() -> None:
    """An engine-wide block_size rewritten to 8 does not override the groups' own geometry."""
    lay = qwen3_next(block_size=8)
    lay.validate_for_store()
    assert lay.hash_block_size == 800
    assert lay.store_groups[1].mamba_cache_mode == "align"


@pytest.mark.parametrize("capacity", [4, 8])
def test_seed_qwen3_next_hybrid_ring_never_enters_hash_block_size(capacity: int) -> None:
    """A QSA ring of capacity 4 or 8 beside 800-token groups never shapes hash_block_size."""
    lay = qwen3_next(ring_capacity=capacity)
    assert lay.hash_block_size == 800
    lay.validate_for_store()
    assert lay.lookup_alignment == 800


# -- projections (property) ------------------------------------------------------------------

KINDS = [kind.value for kind in GroupKind]


@st.composite
def group_dicts(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    group: dict[str, Any] = {
        "kind": kind,
        "block_size": draw(st.sampled_from([4, 8, 16, 32, 64, 800])),
        "enable_kv_transfer": draw(st.booleans()),
    }
    if kind == "mamba":
        group["mamba_cache_mode"] = draw(st.sampled_from(["none", "all", "align"]))
    if kind == "sliding_window":
        group["sliding_window"] = draw(st.integers(1, 4096))
    return group


layouts = st.builds(
    lambda groups, pmu: KVCacheLayout.from_dict({"groups": groups, "prefix_match_unit": pmu}),
    st.lists(group_dicts(), min_size=1, max_size=6),
    st.none() | st.sampled_from([4, 8, 16]),
)


@given(layouts)
def test_projections_follow_transfer_flags_and_kinds(lay: KVCacheLayout) -> None:
    """transfer ids follow enable_kv_transfer; prefix-cacheable ids drop only rings from them."""
    assert lay.transfer_group_ids == tuple(
        i for i, g in enumerate(lay.groups) if g.enable_kv_transfer
    )
    assert lay.prefix_cacheable_group_ids == tuple(
        i for i in lay.transfer_group_ids if lay.groups[i].kind != "circular_buffer"
    )


@given(layouts)
def test_store_group_index_is_position_in_prefix_cacheable_ids(lay: KVCacheLayout) -> None:
    """store_group_index maps each stored kv-cache group to its store index, others to None."""
    stored = lay.prefix_cacheable_group_ids
    for gid in range(len(lay.groups)):
        index = lay.store_group_index(gid)
        if gid in stored:
            assert index is not None and stored[index] == gid
        else:
            assert index is None
    assert sorted(i for g in range(len(lay.groups))
                  if (i := lay.store_group_index(g)) is not None) == list(range(len(stored)))


@given(layouts, st.data())
def test_project_block_ids_keeps_stored_groups_in_store_order(
    lay: KVCacheLayout, data: st.DataObject
) -> None:
    """Block ids project to store groups (and to transfer groups for transfer_all) unchanged."""
    block_ids = tuple(
        data.draw(st.lists(st.integers(0, 10_000), max_size=5)) for _ in lay.groups
    )
    projected = lay.project_block_ids(block_ids)
    assert len(projected) == len(lay.prefix_cacheable_group_ids)
    for gid, ids in enumerate(block_ids):
        index = lay.store_group_index(gid)
        if index is not None:
            assert projected[index] == list(ids)
    assert lay.project_transfer_all(block_ids) == tuple(
        list(block_ids[g]) for g in lay.transfer_group_ids
    )


def test_project_block_ids_rejects_wrong_group_count() -> None:
    """Block ids for a different number of kv-cache groups are refused."""
    with pytest.raises(LayoutError, match="expected block ids for 3 kv-cache groups, got 2"):
        qwen3_next().project_block_ids(([1], [2]))


def test_store_group_index_rejects_unknown_group() -> None:
    """Asking for a kv-cache group id outside the layout raises LayoutError naming it."""
    with pytest.raises(LayoutError, match="kv-cache group 3 does not exist"):
        qwen3_next().store_group_index(3)


@given(layouts)
def test_validate_for_store_accepts_only_hashable_storable_layouts(lay: KVCacheLayout) -> None:
    """An accepted layout stores something, no ring, cross, encoder or non-align mamba group."""
    try:
        lay.validate_for_store()
    except LayoutError as exc:
        assert "group" in str(exc)
        return
    assert lay.prefix_cacheable_group_ids
    hbs = lay.hash_block_size
    for group in lay.store_groups:
        assert group.kind not in ("circular_buffer", "cross_attention", "encoder_only_attention")
        assert group.kind != "mamba" or group.mamba_cache_mode == "align"
        assert group.block_size % hbs == 0
    assert len(lay.payload_layers) == len(lay.store_groups)


# -- hash_block_size -------------------------------------------------------------------------


def test_hash_block_size_single_group_is_its_block_size() -> None:
    """A single group hashes at its own block size."""
    assert layout(full(16)).hash_block_size == 16


def test_hash_block_size_is_gcd_of_prefix_cacheable_groups() -> None:
    """Several groups hash at the gcd of the prefix-cacheable groups' block sizes."""
    assert layout(full(32), swa(48, 128), ring(4)).hash_block_size == 16


def test_hash_block_size_prefers_prefix_match_unit() -> None:
    """prefix_match_unit overrides the gcd for multi-group layouts."""
    assert layout(full(32), full(64), prefix_match_unit=8).hash_block_size == 8


def test_hash_block_size_counts_prefix_cacheable_groups_kept_out_of_transfer() -> None:
    """A prefix-cacheable group with transfer disabled still shapes hash_block_size."""
    lay = layout(full(32), full(16, enable_kv_transfer=False))
    assert lay.prefix_cacheable_group_ids == (0,)
    assert lay.hash_block_size == 16
    lay.validate_for_store()


def test_hash_block_size_backs_off_to_lcm_for_non_align_mamba() -> None:
    """A mamba group outside align mode makes every group hash at the lcm of all sizes."""
    lay = layout(full(16), ring(4), mamba(48, "all"))
    assert lay.hash_block_size == math.lcm(16, 4, 48)


def test_lookup_alignment_with_large_align_mamba_is_hash_block_size() -> None:
    """A mamba (align) group larger than hash_block_size lets hits land on hash blocks."""
    assert layout(full(16), mamba(64, "align")).lookup_alignment == 16
    assert layout(full(16), full(32)).lookup_alignment == 32


# -- validation messages ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "fields", "message"),
    [
        ([ring(4)], {}, "requires at least one prefix-cacheable KV cache group"),
        ([full(16, enable_kv_transfer=False), ring(4)], {},
         "requires at least one prefix-cacheable KV cache group"),
        ([full(16), {"kind": "cross_attention", "block_size": 16}], {},
         "group 1: cross_attention groups cannot be stored"),
        ([{"kind": "encoder_only_attention", "block_size": 16}], {},
         "group 0: encoder_only_attention groups cannot be stored"),
        ([full(16), mamba(16, "all")], {}, "group 1: mamba_cache_mode='all' != 'align'"),
        ([full(32), full(64)], {"prefix_match_unit": 24},
         "group 0: block_size 32 is not a multiple of hash_block_size 24"),
        ([full(32), full(16, enable_kv_transfer=False)], {"prefix_match_unit": 32},
         "group 1: block_size 16 is not a multiple of hash_block_size 32"),
        ([full(16)], {"prefix_match_unit": 8},
         "group 0: prefix_match_unit 8 must equal the single group's block_size 16"),
        ([full(16), full(32)], {"pcp_world_size": 2},
         r"groups \[0, 1\]: hybrid layouts cannot be stored with PCP > 1 \(pcp=2\)"),
        ([full(16), full(32)], {"pcp_rank": 1, "pcp_world_size": 2},
         r"groups \[0, 1\]: hybrid layouts cannot be stored with PCP > 1 \(pcp=2\)"),
    ],
)
def test_validate_for_store_names_group_and_reason(
    groups: list[dict[str, Any]], fields: dict[str, Any], message: str
) -> None:
    """Each refusal names the offending group and the reason."""
    with pytest.raises(LayoutError, match=message):
        layout(*groups, **fields).validate_for_store()


def test_validate_for_store_reports_every_problem() -> None:
    """Several bad groups are all reported in one error."""
    lay = layout(full(16), {"kind": "cross_attention", "block_size": 16}, mamba(16, "none"))
    with pytest.raises(LayoutError) as info:
        lay.validate_for_store()
    assert "group 1: cross_attention" in str(info.value)
    assert "group 2: mamba_cache_mode='none'" in str(info.value)


def test_single_group_pcp_is_storable() -> None:
    """PCP only blocks hybrid layouts; a single stored group may use it."""
    layout(full(16), ring(4), pcp_world_size=4, pcp_rank=3).validate_for_store()


# -- schema ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"groups": [full(16, colour="red")]}, "unknown field `colour` - at `$.groups[0]`"),
        ({"groups": [full(16)], "modle": "x"}, "unknown field `modle`"),
        ({"groups": [{"kind": "flash", "block_size": 16}]}, "$.groups[0].kind"),
        ({"groups": [full("16")]}, "$.groups[0].block_size"),
        ({"groups": [full(True)]}, "$.groups[0].block_size"),
        ({"groups": [full(0)]}, "block_size must be positive, got 0 - at `$.groups[0]`"),
        ({"groups": [full(16, page_bytes=-1)]}, "page_bytes must not be negative"),
        ({"groups": [full(16, dtype="float7")]}, "unknown dtype 'float7'"),
        ({"groups": [full(16, layers=["a", "a"])]}, "layers must be unique"),
        ({"groups": [full(16, layers=["a"]), full(16, layers=["a"])]},
         "layer 'a' appears in groups 0 and 1"),
        ({"groups": [{"kind": "mamba", "block_size": 16}]}, "mamba groups need mamba_cache_mode"),
        ({"groups": [mamba(16, "sometimes")]}, "$.groups[0].mamba_cache_mode"),
        ({"groups": [full(16, mamba_cache_mode="align")]}, "only valid for mamba groups"),
        ({"groups": [{"kind": "sliding_window", "block_size": 16}]},
         "sliding_window groups need a positive sliding_window"),
        ({"groups": [full(16, sliding_window=4)]}, "only valid for sliding_window groups"),
        ({"groups": []}, "at least one kv-cache group"),
        ({"groups": [full(16)], "model": "a@b"}, "model must be non-empty and contain no '@'"),
        ({"groups": [full(16)], "cache_prefix": "x@y"}, "cache_prefix must contain no '@'"),
        ({"groups": [full(16)], "tp_rank": -1}, "tp_rank must not be negative"),
        ({"groups": [full(16)], "pcp_world_size": 0}, "pcp_world_size must be positive"),
        ({"groups": [full(16)], "prefix_match_unit": 0}, "prefix_match_unit must be positive"),
        ({"groups": "full"}, "$.groups"),
    ],
)
def test_from_dict_rejects_bad_input_naming_the_field(data: dict[str, Any], field: str) -> None:
    """Unknown keys and bad values raise LayoutError naming the field or the reason."""
    with pytest.raises(LayoutError) as info:
        KVCacheLayout.from_dict(data)
    assert field in str(info.value)


def test_from_dict_minimal_group_needs_only_kind_and_block_size() -> None:
    """A group dict with only kind and block_size loads with documented defaults."""
    group = layout(full(16)).groups[0]
    assert (group.enable_kv_transfer, group.layers, group.dtype, group.page_bytes) == (
        True, (), "bfloat16", 0,
    )


@given(layouts)
def test_to_dict_round_trips(lay: KVCacheLayout) -> None:
    """to_dict output loads back to an equal layout."""
    assert KVCacheLayout.from_dict(lay.to_dict()) == lay


def test_fingerprint_changes_with_stored_geometry_only() -> None:
    """The fingerprint changes with stored geometry and ranks, not with the ring's capacity."""
    base = qwen3_next(ring_capacity=4)
    assert base.fingerprint == qwen3_next(ring_capacity=8).fingerprint
    assert base.fingerprint != qwen3_next(ring_capacity=4, tp_rank=1, tp_size=2).fingerprint
    assert base.fingerprint != layout(
        full(800, layers=["model.layers.3.self_attn.attn"], dtype="float8_e4m3fn"),
        ring(4, layers=["model.layers.3.self_attn.qsa_ring"]),
        mamba(800, "align", layers=["model.layers.0.linear_attn"]),
    ).fingerprint
