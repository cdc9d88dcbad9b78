"""vLLM's ``KVCacheConfig`` as a kvsidecar layout, and what vLLM hashes besides tokens.

Spec classes are matched by name, exactly: a spec kvsidecar does not know is refused,
never guessed at (a subclass may store its KV differently). The converted layout must
project its groups exactly as vLLM does (``transfer_group_ids``,
``prefix_cacheable_group_ids``), or store group indices would name other groups' blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pipeline.core.errors import LayoutError
from pipeline.core.layout import GroupKind, KVCacheGroup, KVCacheLayout, MambaCacheMode

__all__ = [
    "layout_from_vllm",
    "model_name",
    "request_keys",
    "store_namespace",
    "vllm_block_hasher",
]

_KINDS = {
    "FullAttentionSpec": GroupKind.FULL_ATTENTION,
    "MLAAttentionSpec": GroupKind.MLA_ATTENTION,
    "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
    "SlidingWindowMLASpec": GroupKind.SLIDING_WINDOW,
    "ChunkedLocalAttentionSpec": GroupKind.CHUNKED_LOCAL_ATTENTION,
    "MambaSpec": GroupKind.MAMBA,
    "CircularBufferSpec": GroupKind.CIRCULAR_BUFFER,
    "CrossAttentionSpec": GroupKind.CROSS_ATTENTION,
    "EncoderOnlyAttentionSpec": GroupKind.ENCODER_ONLY_ATTENTION,
}
_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


def model_name(model: str) -> str:
    """The model's name in store keys: the basename of its path, as vLLM's own store
    connector names it."""
    return os.path.basename(os.path.normpath(model)) or model


def _dtype(spec: Any) -> str:
    dtypes = getattr(spec, "dtypes", None) or (getattr(spec, "dtype", None),)
    name = str(dtypes[0]).removeprefix("torch.")
    return name if name in _DTYPES else "uint8"


def _group(group_id: int, group: Any) -> KVCacheGroup:
    spec = group.kv_cache_spec
    spec_name = type(spec).__name__
    if spec_name == "UniformTypeKVCacheSpecs":
        # Layers of one attention type with different shapes: one kind, pages per layer.
        names = {type(inner).__name__ for inner in spec.kv_cache_specs.values()}
        inner = next(iter(spec.kv_cache_specs.values()))
        if len(names) != 1:
            raise LayoutError(f"group {group_id}: mixes vLLM specs {sorted(names)}")
        spec, spec_name, page_bytes = inner, names.pop(), 0
    elif spec_name == "MambaSpec":
        # Mamba state is padded to the attention page (``page_size_padded``): the page
        # stored is the state itself, each layer's views of it, without the padding.
        page_bytes = int(spec.state_content_size_bytes)
    else:
        page_bytes = int(spec.page_size_bytes)
    kind = _KINDS.get(spec_name)
    if kind is None:
        raise LayoutError(
            f"group {group_id}: vLLM's {spec_name} is not supported by kvsidecar "
            f"(supported: {', '.join(sorted(_KINDS))})"
        )
    if kind in (GroupKind.CROSS_ATTENTION, GroupKind.ENCODER_ONLY_ATTENTION):
        raise LayoutError(
            f"group {group_id}: {kind} KV (vLLM's {spec_name}) cannot be stored by prefix; "
            "kvsidecar serves decoder KV caches only"
        )
    mamba_mode = None
    if kind is GroupKind.MAMBA:
        mamba_mode = MambaCacheMode(str(spec.mamba_cache_mode))
    return KVCacheGroup(
        kind=kind,
        block_size=int(spec.block_size),
        layers=tuple(group.layer_names),
        enable_kv_transfer=bool(getattr(group, "enable_kv_transfer", True)),
        mamba_cache_mode=mamba_mode,
        sliding_window=int(spec.sliding_window) if kind is GroupKind.SLIDING_WINDOW else None,
        dtype=_dtype(spec),
        page_bytes=page_bytes,
        mla=spec_name in ("MLAAttentionSpec", "SlidingWindowMLASpec"),
    )


def layout_from_vllm(
    kv_cache_config: Any,
    *,
    model: str,
    tp_rank: int = 0,
    pcp_rank: int = 0,
    dcp_rank: int = 0,
    pp_rank: int = 0,
    pcp_world_size: int = 1,
    tp_size: int = 1,
    pp_size: int = 1,
    dcp_size: int = 1,
    num_kv_heads: int = 0,
    store_namespace: str = "",
    cache_prefix: str = "",
    block_size: int | None = None,
) -> KVCacheLayout:
    """The layout of a vLLM ``KVCacheConfig``, validated for the store.

    Raises ``LayoutError`` naming the group for a spec kvsidecar cannot store, and when
    the projections would differ from vLLM's own.
    """
    groups = tuple(_group(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups))
    try:
        layout = KVCacheLayout(
            groups=groups, model=model_name(model), tp_rank=tp_rank, pcp_rank=pcp_rank,
            dcp_rank=dcp_rank, pp_rank=pp_rank, pcp_world_size=pcp_world_size,
            tp_size=tp_size, pp_size=pp_size, dcp_size=dcp_size, num_kv_heads=num_kv_heads,
            store_namespace=store_namespace, cache_prefix=cache_prefix, block_size=block_size,
        )
    except ValueError as exc:
        raise LayoutError(f"invalid KV-cache layout: {exc}") from exc
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size and hash_block_size != layout.hash_block_size:
        # vLLM hashes at its own granularity; fine hashes and keys must follow it.
        layout = msgspec.structs.replace(layout, prefix_match_unit=int(hash_block_size))
    for name in ("transfer_group_ids", "prefix_cacheable_group_ids"):
        theirs = getattr(kv_cache_config, name, None)
        if theirs is not None and tuple(theirs) != getattr(layout, name):
            raise LayoutError(
                f"{name}: vLLM has {tuple(theirs)}, the converted layout {getattr(layout, name)}"
            )
    layout.validate_for_store()
    return layout


def store_namespace(
    store_tp_size: int | None, *, tp_size: int, pp_size: int, num_kv_heads: int,
    cache_layout: str, tp_sharded: bool,
) -> str:
    """vLLM 0.33's ``store_namespace`` for a ``store_tp_size``, as its Mooncake store
    worker picks it. ``tp_sharded``: vLLM could shard this layout across TP ranks (one
    full-attention group, no PCP/DCP, a head-major or token-major cache layout)."""
    if store_tp_size is None:
        return ""
    if store_tp_size >= tp_size and store_tp_size % tp_size == 0 and tp_sharded:
        if num_kv_heads % store_tp_size == 0:
            raise LayoutError(
                f"store_tp_size {store_tp_size}: vLLM stores this layout TP-sharded "
                "(store_format tp_shared_*); kvsidecar stores rank-local values only"
            )
        if num_kv_heads == 1:
            return f"@store_pp:{pp_size}@store_format:tp_shared_mqa"
    return f"@store_pp:{pp_size}@store_format:rank_local_tp{tp_size}_layout_{cache_layout}"


def request_keys(request: Any) -> dict[str, Any]:
    """What vLLM hashes besides a request's tokens, as ``EngineClient`` takes it."""
    keys: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys["lora_name"], keys["lora_path"] = lora.lora_name, lora.lora_path
    if getattr(request, "cache_salt", None):
        keys["cache_salt"] = request.cache_salt
    features = getattr(request, "mm_features", None) or ()
    if features:
        keys["mm_items"] = [
            (f.identifier, f.mm_position.offset, f.mm_position.length) for f in features
        ]
    return keys


def vllm_block_hasher(algo: str) -> Callable[[Sequence[int], int], list[bytes]]:
    """vLLM's own block hashing with ``prefix_caching_hash_algo`` ``algo``, for the
    registration self-test: the sidecar checks it against its own where it can."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(algo)
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        # A worker process that did not start the engine core has not seeded it.
        kv_cache_utils.init_none_hash(hash_fn)

    def hashes(tokens: Sequence[int], size: int) -> list[bytes]:
        parent: Any = None
        result = []
        for start in range(0, len(tokens) - size + 1, size):
            parent = kv_cache_utils.hash_block_tokens(
                hash_fn, parent, tuple(tokens[start : start + size]), None
            )
            result.append(bytes(parent))
        return result

    return hashes
