"""Byte and decision compatibility with vLLM 0.33 (installed with --no-deps beside us)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    MooncakeStoreCoordinator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, PoolKey
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    generate_block_hash_extra_keys,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.request import Request

from pipeline.core.hashing import block_hashes, group_block_hashes, none_hash, sha256_cbor
from pipeline.core.keys import store_key
from pipeline.core.layout import KVCacheLayout, LayoutError

pytestmark = pytest.mark.vllm

COMPAT = settings(max_examples=60, deadline=None)


@pytest.fixture(autouse=True)
def _default_none_hash() -> Iterator[None]:
    """Every test starts and ends with vLLM's NONE_HASH derived from the default seed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONHASHSEED", raising=False)
        init_none_hash(vllm_sha256_cbor)
    yield
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONHASHSEED", raising=False)
        init_none_hash(vllm_sha256_cbor)


def vllm_chain(tokens: list[int], size: int) -> list[bytes]:
    parent: bytes | None = None
    out: list[bytes] = []
    for start in range(0, len(tokens) - size + 1, size):
        parent = hash_block_tokens(vllm_sha256_cbor, parent, tokens[start : start + size])
        out.append(parent)
    return out


tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=200)
block_st = st.sampled_from([1, 2, 3, 4, 8, 16, 17])


# -- hashes ----------------------------------------------------------------------------------


def test_sha256_cbor_and_none_hash_match() -> None:
    """sha256_cbor and the default NONE_HASH are byte-identical to vLLM's."""
    value = (b"x" * 32, (1, 2, 3), (("lora", "a", "/p"),))
    assert sha256_cbor(value) == vllm_sha256_cbor(value)
    assert none_hash() == kv_cache_utils.NONE_HASH


@COMPAT
@given(tokens_st, block_st)
def test_block_hashes_match_hash_block_tokens(tokens: list[int], size: int) -> None:
    """Fine hashes of random token sequences equal vLLM's hash_block_tokens chain."""
    assert block_hashes(tokens, size) == vllm_chain(tokens, size)


@COMPAT
@given(tokens_st, block_st, st.sampled_from(["0", "1", "4242", "random"]))
def test_block_hashes_match_with_pythonhashseed(tokens: list[int], size: int, seed: str) -> None:
    """With PYTHONHASHSEED set for vLLM and the same seed passed to us, hashes agree."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", seed)
        init_none_hash(vllm_sha256_cbor)
    assert none_hash(seed) == kv_cache_utils.NONE_HASH
    assert block_hashes(tokens, size, seed=seed) == vllm_chain(tokens, size)


# -- extra keys ------------------------------------------------------------------------------


@st.composite
def mm_layouts(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """Non-overlapping items sorted by offset, as vLLM assumes."""
    items = []
    position = 0
    for index in range(draw(st.integers(0, 4))):
        position += draw(st.integers(0, 20))
        length = draw(st.integers(1, 30))
        items.append((f"hash-{index}-{draw(st.sampled_from('ab'))}", position, length))
        position += length
    return items


@dataclass
class RequestCase:
    tokens: list[int]
    size: int
    lora: tuple[str, str] | None
    salt: str | None
    mm: list[tuple[str, int, int]]

    def ours(self, tokens: list[int] | None = None) -> list[bytes]:
        lora_name, lora_path = self.lora or (None, None)
        return block_hashes(self.tokens if tokens is None else tokens, self.size,
                            lora_name=lora_name, lora_path=lora_path, cache_salt=self.salt,
                            mm_items=self.mm)

    def features(self) -> list[MultiModalFeatureSpec]:
        return [
            MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                  mm_position=PlaceholderRange(offset=offset, length=length))
            for ident, offset, length in self.mm
        ]

    def vllm_request(self, prompt: list[int]) -> Request:
        lora = LoRARequest(self.lora[0], 1, self.lora[1]) if self.lora else None
        return Request("req", prompt, SamplingParams(max_tokens=1), None,
                       mm_features=self.features(), lora_request=lora, cache_salt=self.salt,
                       block_hasher=get_request_block_hasher(self.size, vllm_sha256_cbor))


cases = st.builds(
    RequestCase,
    tokens=st.lists(st.integers(0, 50_000), min_size=1, max_size=160),
    size=st.sampled_from([4, 8, 16]),
    lora=st.none() | st.tuples(st.sampled_from(["sql", "chat"]),
                                st.sampled_from(["/adapters/sql", "s3://b/chat"])),
    salt=st.none() | st.sampled_from(["", "tenant-a"]),
    mm=mm_layouts(),
)


@COMPAT
@given(cases, st.integers(0, 160))
def test_request_block_hasher_matches_including_growth(case: RequestCase, cut: int) -> None:
    """A real vLLM Request's block hashes (prompt, then decoded tokens) equal ours."""
    prompt = case.tokens[: max(1, min(cut, len(case.tokens)))]
    request = case.vllm_request(prompt)
    assert list(request.block_hashes) == case.ours(prompt)
    request.append_output_token_ids(case.tokens[len(prompt) :])
    assert list(request.block_hashes) == case.ours()


@COMPAT
@given(cases)
def test_generate_block_hash_extra_keys_matches(case: RequestCase) -> None:
    """Chaining vLLM's generate_block_hash_extra_keys per block gives our hashes."""
    request = case.vllm_request(case.tokens)
    parent: bytes | None = None
    expected = []
    mm_index = 0
    for start in range(0, len(case.tokens) - case.size + 1, case.size):
        extra, mm_index = generate_block_hash_extra_keys(
            request, start, start + case.size, mm_index
        )
        parent = hash_block_tokens(vllm_sha256_cbor, parent,
                                   case.tokens[start : start + case.size], extra)
        expected.append(parent)
    assert case.ours() == expected


def _request_like(lora_request: Any) -> SimpleNamespace:
    return SimpleNamespace(lora_request=lora_request, mm_features=[], cache_salt=None,
                           prompt_embeds=None, _prompt_embeds_per_block_hashes={})


def test_lora_path_default_semantics() -> None:
    """vLLM refuses a LoRA without a path; its field default '' hashes as our missing path."""
    with pytest.raises(AssertionError, match="lora_path cannot be empty"):
        LoRARequest("sql", 1)
    tokens = list(range(16))
    extra, _ = generate_block_hash_extra_keys(
        _request_like(SimpleNamespace(lora_name="sql", lora_path="")), 0, 16, 0
    )
    assert extra == (("lora", "sql", ""),)
    expected = [hash_block_tokens(vllm_sha256_cbor, None, tokens, extra)]
    assert block_hashes(tokens, 16, lora_name="sql") == expected
    assert block_hashes(tokens, 16, lora_name="sql", lora_path="") == expected


def test_empty_lora_name_is_keyed_like_vllm() -> None:
    """A LoRA request with an empty name still gets vLLM's ("lora", "", path) key."""
    tokens = list(range(16))
    extra, _ = generate_block_hash_extra_keys(
        _request_like(LoRARequest("", 1, "/p")), 0, 16, 0
    )
    assert extra == (("lora", "", "/p"),)
    assert block_hashes(tokens, 16, lora_name="", lora_path="/p") == [
        hash_block_tokens(vllm_sha256_cbor, None, tokens, extra)
    ]


# -- coarse view -----------------------------------------------------------------------------


@COMPAT
@given(st.integers(0, 50), st.sampled_from([1, 4, 16]), st.integers(1, 8))
def test_group_view_matches_block_hash_list_with_block_size(n: int, hbs: int, k: int) -> None:
    """The coarse per-group view equals vLLM's BlockHashListWithBlockSize."""
    fine = vllm_chain(list(range(n * hbs)), hbs)
    view = BlockHashListWithBlockSize(fine, hbs, k * hbs)
    assert group_block_hashes(fine, hbs, k * hbs) == list(view) == view[:]


# -- layouts ---------------------------------------------------------------------------------

ATTN = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
STORE_KINDS = ["full_attention", "sliding_window", "chunked_local_attention", "mla_attention",
               "mamba", "circular_buffer", "cross_attention"]


def vllm_spec(kind: str, block_size: int, mode: str = "align") -> kvi.KVCacheSpec:
    if kind == "full_attention":
        return kvi.FullAttentionSpec(block_size=block_size, **ATTN)
    if kind == "sliding_window":
        return kvi.SlidingWindowSpec(block_size=block_size, sliding_window=128, **ATTN)
    if kind == "chunked_local_attention":
        return kvi.ChunkedLocalAttentionSpec(block_size=block_size, attention_chunk_size=256,
                                             **ATTN)
    if kind == "mla_attention":
        return kvi.MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                    dtype=torch.bfloat16)
    if kind == "mamba":
        return kvi.MambaSpec(block_size=block_size, shapes=((4, 64), (8, 16, 16)),
                             dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode)
    if kind == "circular_buffer":
        return kvi.CircularBufferSpec(block_size=block_size, **ATTN)
    if kind == "cross_attention":
        return kvi.CrossAttentionSpec(block_size=block_size, **ATTN)
    if kind == "encoder_only_attention":
        return kvi.EncoderOnlyAttentionSpec(block_size=block_size, **ATTN)
    raise AssertionError(kind)


def to_layout_dict(config: kvi.KVCacheConfig, vllm_config: Any) -> dict[str, Any]:
    """Our layout schema, read off a vLLM KVCacheConfig (the engine-side adapter's job)."""
    kinds = [  # most specific first: every attention spec derives from AttentionSpec
        (kvi.CircularBufferSpec, "circular_buffer"), (kvi.MLAAttentionSpec, "mla_attention"),
        (kvi.SlidingWindowSpec, "sliding_window"),
        (kvi.ChunkedLocalAttentionSpec, "chunked_local_attention"),
        (kvi.CrossAttentionSpec, "cross_attention"),
        (kvi.EncoderOnlyAttentionSpec, "encoder_only_attention"),
        (kvi.FullAttentionSpec, "full_attention"), (kvi.MambaSpec, "mamba"),
    ]
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = next(name for cls, name in kinds if isinstance(spec, cls))
        entry: dict[str, Any] = {
            "kind": kind, "block_size": spec.block_size, "layers": list(group.layer_names),
            "enable_kv_transfer": group.enable_kv_transfer, "page_bytes": spec.page_size_bytes,
        }
        if kind == "mamba":
            entry["mamba_cache_mode"] = spec.mamba_cache_mode
        if kind == "sliding_window":
            entry["sliding_window"] = spec.sliding_window
        groups.append(entry)
    layout: dict[str, Any] = {
        "model": "m", "groups": groups,
        "prefix_match_unit": vllm_config.cache_config.prefix_match_unit,
    }
    pcp = vllm_config.parallel_config.prefill_context_parallel_size
    if pcp != 1:
        layout["pcp_world_size"] = pcp
    return layout


def build(
    groups: list[tuple[str, int, bool, str]], prefix_match_unit: int | None = None, pcp: int = 1
) -> tuple[kvi.KVCacheConfig, Any, KVCacheLayout]:
    """A vLLM KVCacheConfig, a VllmConfig-like object and our layout built from them."""
    config = kvi.KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[
            kvi.KVCacheGroupSpec([f"layers.{gid}.{kind}"], vllm_spec(kind, size, mode),
                                 enable_kv_transfer=transfer)
            for gid, (kind, size, transfer, mode) in enumerate(groups)
        ],
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=groups[0][1], prefix_match_unit=prefix_match_unit,
            enable_prefix_caching=True, mamba_cache_mode="align",
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                        prefill_context_parallel_size=pcp),
        kv_transfer_config=SimpleNamespace(kv_connector="MooncakeStoreConnector"),
        speculative_config=None,
    )
    return config, vllm_config, KVCacheLayout.from_dict(to_layout_dict(config, vllm_config))


def vllm_accepts(config: kvi.KVCacheConfig, vllm_config: Any) -> tuple[bool, int | None]:
    """Whether vLLM's MooncakeStoreConnector would start on this config, and its hash size."""
    try:
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            config, vllm_config
        )
    except ValueError:
        return False, None
    try:
        MooncakeStoreConnector._validate_kv_cache_config(vllm_config, config)
        MooncakeStoreCoordinator.from_kv_cache_config(
            config, vllm_config, scheduler_block_size, hash_block_size
        )
    except (ValueError, AssertionError):
        return False, hash_block_size
    return True, hash_block_size


group_st = st.tuples(
    st.sampled_from(STORE_KINDS),
    st.sampled_from([4, 8, 16, 32, 48, 64, 800]),
    st.booleans() | st.just(True),
    st.sampled_from(["align", "align", "none", "all"]),
)
configs_st = st.tuples(
    st.lists(group_st, min_size=1, max_size=5),
    st.none() | st.sampled_from([4, 8, 16, 24]),
    st.sampled_from([1, 1, 2]),
)


@COMPAT
@given(configs_st)
def test_group_projections_match_kv_cache_config(case: Any) -> None:
    """transfer ids, prefix-cacheable ids and store indices equal vLLM's for any config."""
    config, _, lay = build(*case)
    assert lay.transfer_group_ids == config.transfer_group_ids
    assert lay.prefix_cacheable_group_ids == config.prefix_cacheable_group_ids
    # The MooncakeStore scheduler numbers store groups by position in this tuple.
    vllm_index = {gid: i for i, gid in enumerate(config.prefix_cacheable_group_ids)}
    for gid in range(len(config.kv_cache_groups)):
        assert lay.store_group_index(gid) == vllm_index.get(gid)
    block_ids = tuple([gid * 10 + 1] for gid in range(len(config.kv_cache_groups)))
    assert lay.project_transfer_all(block_ids) == config.select_transfer_block_ids(block_ids)


@COMPAT
@given(configs_st)
def test_hash_block_size_and_store_validation_match_vllm(case: Any) -> None:
    """hash_block_size and accept/reject equal vLLM's resolver and MooncakeStore checks."""
    config, vllm_config, lay = build(*case)
    accepted, hash_block_size = vllm_accepts(config, vllm_config)
    if hash_block_size is not None:
        assert lay.hash_block_size == hash_block_size
    try:
        lay.validate_for_store()
    except LayoutError:
        assert not accepted
    else:
        assert accepted


def test_seed_qwen3_next_hybrid_matches_vllm() -> None:
    """full(800) + ring(8) + mamba(800, align): vLLM and we store groups 0 and 2 at 800."""
    config, vllm_config, lay = build([
        ("full_attention", 800, True, "align"), ("circular_buffer", 8, True, "align"),
        ("mamba", 800, True, "align"),
    ])
    vllm_config.cache_config.block_size = 8  # a rewritten engine-wide block size changes nothing
    assert vllm_accepts(config, vllm_config) == (True, 800)
    lay.validate_for_store()
    assert (lay.prefix_cacheable_group_ids, lay.hash_block_size) == ((0, 2), 800)


def test_encoder_only_groups_are_refused_although_vllm_accepts_them() -> None:
    """Deliberate divergence: we fail closed on encoder-only groups, vLLM's store does not."""
    config, vllm_config, lay = build([("encoder_only_attention", 16, True, "align")])
    MooncakeStoreConnector._validate_kv_cache_config(vllm_config, config)
    with pytest.raises(LayoutError, match="group 0: encoder_only_attention"):
        lay.validate_for_store()


# -- keys ------------------------------------------------------------------------------------


@COMPAT
@given(
    st.text(st.characters(blacklist_characters="@", blacklist_categories=("Cs",)), min_size=1,
            max_size=16),
    st.binary(min_size=32, max_size=32),
    st.tuples(*(st.integers(0, 16) for _ in range(5))),
    st.just("") | st.sampled_from(["prod", "team-a/ns"]),
)
def test_store_key_matches_pool_key(
    model: str, digest: bytes, ranks: tuple[int, ...], prefix: str
) -> None:
    """store_key equals vLLM's PoolKey(KeyMetadata(...), hex).to_string(), prefix included."""
    tp, pcp, dcp, pp, group = ranks
    expected = PoolKey(
        KeyMetadata(model_name=model, tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp,
                    group_id=group, cache_prefix=prefix),
        digest.hex(),
    ).to_string()
    assert store_key(model, digest, store_group=group, tp_rank=tp, pcp_rank=pcp,
                     dcp_rank=dcp, pp_rank=pp, cache_prefix=prefix) == expected

