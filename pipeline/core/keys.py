"""Store keys in the vLLM MooncakeStoreConnector format, so both can share one store.

``[{cache_prefix}@]{model}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{store_index}@{hex}``
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.core.layout import KVCacheLayout

__all__ = ["key_prefix", "keys_for", "layout_key_prefixes", "store_key"]


def key_prefix(
    model: str,
    *,
    store_group: int,
    tp_rank: int = 0,
    pcp_rank: int = 0,
    dcp_rank: int = 0,
    pp_rank: int = 0,
    cache_prefix: str = "",
) -> str:
    """Everything of a key but the block hash (constant per engine and store group)."""
    namespace = f"{cache_prefix}@" if cache_prefix else ""
    return (
        f"{namespace}{model}@tp_rank:{tp_rank}@pcp{pcp_rank}@dcp{dcp_rank}"
        f"@pp_rank:{pp_rank}@group:{store_group}"
    )


def store_key(
    model: str,
    block_hash: bytes,
    *,
    store_group: int,
    tp_rank: int = 0,
    pcp_rank: int = 0,
    dcp_rank: int = 0,
    pp_rank: int = 0,
    cache_prefix: str = "",
) -> str:
    prefix = key_prefix(
        model, store_group=store_group, tp_rank=tp_rank, pcp_rank=pcp_rank,
        dcp_rank=dcp_rank, pp_rank=pp_rank, cache_prefix=cache_prefix,
    )
    return keys_for(prefix, (block_hash,))[0]


def keys_for(prefix: str, block_hashes: Iterable[bytes]) -> list[str]:
    """The store keys of blocks under a ``key_prefix`` (the one place keys are spelled)."""
    return [f"{prefix}@{block_hash.hex()}" for block_hash in block_hashes]


def layout_key_prefixes(layout: KVCacheLayout) -> tuple[str, ...]:
    """Key prefix of each store group of a layout, indexed by store-group index."""
    return tuple(
        key_prefix(
            layout.model, store_group=index, tp_rank=layout.tp_rank, pcp_rank=layout.pcp_rank,
            dcp_rank=layout.dcp_rank, pp_rank=layout.pp_rank, cache_prefix=layout.cache_prefix,
        )
        for index in range(len(layout.prefix_cacheable_group_ids))
    )
