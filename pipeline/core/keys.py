"""Store keys in the vLLM MooncakeStoreConnector format.

``[{cache_prefix}@]{model}{namespace}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{store_index}@{hex}``

Two value formats (``store.value_format``) decide the namespace and the ranks in a key:

- ``vllm``: the keys vLLM 0.33's worker writes for the same engine, so both share one
  cluster. ``namespace`` is vLLM's ``store_namespace``; ``tp`` is the rank divided by the
  group's replication factor (ranks holding byte-identical KV share one key).
- ``native``: kvsidecar's own values (with their checksum inside) under a namespace
  vLLM never reads, naming the layout's geometry: engines that store differently never
  meet under one key.

A block is a hit only if every tp-shard x pcp x pp namespace holds it, as vLLM's lookup
requires: each rank loads its own shard.

Not built: vLLM's sub-block keys (a prompt's partial tail keyed by the hash at the
prompt's Mamba checkpoint, and Mamba states handed off at non-block-aligned boundaries;
vLLM 0.33 writes them only with partial hash hits). kvsidecar keys every block by the
hash at its end, so those keys are misses for it, never misread.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from typing import cast

from pipeline.core.layout import GroupKind, KVCacheGroup, KVCacheLayout

__all__ = [
    "RUN_BLOCKS",
    "GroupKeys",
    "KeySpeller",
    "ValueFormat",
    "key_prefix",
    "keys_for",
    "layout_keys",
    "parse_key",
    "replication_factor",
    "store_key",
]


class ValueFormat(enum.StrEnum):
    NATIVE = "native"
    VLLM = "vllm"


def key_prefix(
    model: str,
    *,
    store_group: int,
    tp_rank: int = 0,
    pcp_rank: int = 0,
    dcp_rank: int = 0,
    pp_rank: int = 0,
    cache_prefix: str = "",
    namespace: str = "",
) -> str:
    """Everything of a key but the block hash (constant per engine and store group)."""
    prefix = f"{cache_prefix}@" if cache_prefix else ""
    return (
        f"{prefix}{model}{namespace}@tp_rank:{tp_rank}@pcp{pcp_rank}@dcp{dcp_rank}"
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
    namespace: str = "",
) -> str:
    prefix = key_prefix(
        model, store_group=store_group, tp_rank=tp_rank, pcp_rank=pcp_rank,
        dcp_rank=dcp_rank, pp_rank=pp_rank, cache_prefix=cache_prefix, namespace=namespace,
    )
    return keys_for(prefix, (block_hash,))[0]


def keys_for(prefix: str, block_hashes: Iterable[bytes]) -> list[str]:
    """The store keys of blocks under a ``key_prefix`` (the one place keys are spelled)."""
    # map runs both loops in C: a lookup spells a key for every block of the prompt.
    return list(map(f"{prefix}@".__add__, map(bytes.hex, block_hashes)))


RUN_BLOCKS = 8
"""Runs of at least this many hashes ``KeySpeller.run_keys`` remembers whole: below it, a
dictionary probe a block costs no more than finding and comparing the run."""


class KeySpeller:
    """``keys_for``, remembering the keys it spelled: a block saved and then looked up,
    or a prompt looked up at every scheduler step while it waits, is spelled once. A
    remembered key also carries its string hash, so a store's index finds it without
    hashing it again. Past ``capacity`` keys (about 250 bytes each) it forgets them all
    and starts over; a call for more keys than that spells them without remembering.
    Not thread-safe: one event loop spells.

    ``run_keys`` also remembers a run of ``RUN_BLOCKS`` hashes or more whole, by its last
    hash, for a lookup: asked for again (the same prompt at every step, its hashes
    decoded anew), it is compared hash by hash in one C loop and its keys handed back,
    without a dictionary probe and a string hash a block. Runs hold at most ``capacity``
    keys in all, the oldest forgotten first. Saves and loads name blocks asked for once,
    and use ``keys``: their runs would only push the lookups' out."""

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self._spelled: dict[str, dict[bytes, str]] = {}
        """Key prefix -> block hash -> key."""
        self._count = 0
        self._runs: dict[tuple[str, bytes], tuple[tuple[bytes, ...], tuple[str, ...]]] = {}
        """(key prefix, last hash) -> a run's hashes and keys, oldest first."""
        self._run_keys = 0

    def __len__(self) -> int:
        return self._count

    def run_keys(self, prefix: str, block_hashes: Sequence[bytes]) -> list[str]:
        """``keys``, for a run that may be asked for again as it is (a lookup's)."""
        if len(block_hashes) < RUN_BLOCKS:
            return self.keys(prefix, block_hashes)
        hashes = tuple(block_hashes)
        run_key = (prefix, hashes[-1])
        run = self._runs.get(run_key)
        if run is not None and run[0] == hashes:
            return list(run[1])
        keys = self.keys(prefix, hashes)
        self._remember_run(run_key, hashes, keys)
        return keys

    def keys(self, prefix: str, block_hashes: Sequence[bytes]) -> list[str]:
        spelled = self._spelled.get(prefix)
        if spelled is None:
            spelled = self._spelled[prefix] = {}
        found = list(map(spelled.get, block_hashes))  # C loops throughout
        if all(found):  # every one remembered (a key is never empty)
            return cast(list[str], found)
        if len(block_hashes) > self.capacity:  # more than it remembers: none kept
            return keys_for(prefix, block_hashes)
        if self._count + len(block_hashes) > self.capacity:
            for remembered in self._spelled.values():
                remembered.clear()
            self._count = 0
        if not any(found):
            keys = keys_for(prefix, block_hashes)
            fresh = dict(zip(block_hashes, keys, strict=True))
        else:
            missing = [h for h, key in zip(block_hashes, found, strict=True) if key is None]
            fresh = dict(zip(missing, keys_for(prefix, missing), strict=True))
            keys = [key or fresh[h] for h, key in zip(block_hashes, found, strict=True)]
        before = len(spelled)
        spelled.update(fresh)
        self._count += len(spelled) - before
        return keys

    def _remember_run(self, run_key: tuple[str, bytes], hashes: tuple[bytes, ...],
                      keys: list[str]) -> None:
        if len(hashes) > self.capacity:
            return
        runs = self._runs
        replaced = runs.pop(run_key, None)
        if replaced is not None:
            self._run_keys -= len(replaced[0])
        runs[run_key] = (hashes, tuple(keys))
        self._run_keys += len(hashes)
        while self._run_keys > self.capacity:
            self._run_keys -= len(runs.pop(next(iter(runs)))[0])


def parse_key(key: str) -> tuple[int, bytes] | None:
    """(store group index, block hash) of a key, or None if it is not one."""
    rest, _, digest = key.rpartition("@")
    _, _, group = rest.rpartition("@group:")
    try:
        return int(group), bytes.fromhex(digest)
    except ValueError:
        return None


def replication_factor(layout: KVCacheLayout, group: KVCacheGroup) -> int:
    """TP ranks holding byte-identical KV of a group, as vLLM's worker counts them:
    1 with DCP or Mamba state, every rank for MLA, ``tp_size // num_kv_heads`` for GQA."""
    if layout.dcp_size > 1 or group.kind is GroupKind.MAMBA:
        return 1
    if group.kind is GroupKind.MLA_ATTENTION or group.mla:
        return layout.tp_size
    if not layout.num_kv_heads:
        return 1
    return max(1, layout.tp_size // layout.num_kv_heads)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupKeys:
    own: str
    """The prefix this engine saves and loads the group's blocks under."""
    lookup: tuple[str, ...]
    """The prefixes of every rank namespace: a block is a hit when all hold it."""


def layout_keys(layout: KVCacheLayout, value_format: ValueFormat) -> tuple[GroupKeys, ...]:
    """Key prefixes of each store group of a layout, indexed by store-group index."""
    if value_format is ValueFormat.VLLM:
        namespace = layout.store_namespace
    else:
        namespace = f"@store_format:kvsidecar_native_{layout.geometry_fingerprint}"
    result = []
    for index, group in enumerate(layout.store_groups):
        factor = replication_factor(layout, group) if value_format is ValueFormat.VLLM else 1

        def prefix(tp: int, pcp: int, dcp: int, pp: int, *, store_group: int = index) -> str:
            return key_prefix(
                layout.model, store_group=store_group, tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp,
                pp_rank=pp, cache_prefix=layout.cache_prefix, namespace=namespace,
            )

        if layout.dcp_size > 1:  # DCP subdivides TP: dcp_rank == tp_rank % dcp_size
            ranks = [(tp, pcp, tp % layout.dcp_size, pp) for pcp in range(layout.pcp_world_size)
                     for tp in range(layout.tp_size) for pp in range(layout.pp_size)]
        else:
            ranks = [(shard, pcp, 0, pp) for pcp in range(layout.pcp_world_size)
                     for shard in range(layout.tp_size // factor)
                     for pp in range(layout.pp_size)]
        own = prefix(layout.tp_rank // factor, layout.pcp_rank, layout.dcp_rank, layout.pp_rank)
        result.append(GroupKeys(own, tuple(prefix(*r) for r in ranks)))
    return tuple(result)
