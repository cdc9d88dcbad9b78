"""The KV-cache layout an engine registers, its group projections and store validation.

Projections follow vLLM 0.33 ``KVCacheConfig`` exactly: kv-cache group ids index the
engine's groups; *store group indices* are positions inside ``prefix_cacheable_group_ids``.
Engine-facing structures use kv-cache group ids, store-facing ones use store indices.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

from pipeline.core.errors import LayoutError

__all__ = [
    "MAX_BLOCK_TOKENS",
    "NULL_BLOCK_ID",
    "GroupKind",
    "KVCacheGroup",
    "KVCacheLayout",
    "LayoutError",
    "MambaCacheMode",
]

NULL_BLOCK_ID = 0
"""The engine's null block: a placeholder that is never read, written or stored."""

MAX_BLOCK_TOKENS = 1 << 16
"""Tokens per block the protocol admits (the config caps it lower: ``limits``)."""

MAX_RANKS = 256
"""Ranks of one model (tp x pp x pcp x dcp): a lookup spells a key per rank namespace
and block."""
MAX_KV_HEADS = 1 << 16

_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Count = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
_Tokens = Annotated[int, msgspec.Meta(le=MAX_BLOCK_TOKENS)]


class GroupKind(enum.StrEnum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    MLA_ATTENTION = "mla_attention"
    MAMBA = "mamba"
    CIRCULAR_BUFFER = "circular_buffer"
    CROSS_ATTENTION = "cross_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"

    @property
    def prefix_cacheable(self) -> bool:
        # Scratch state (the QSA ring) is rebuilt per request and never shared by prefix.
        return self is not GroupKind.CIRCULAR_BUFFER

    @property
    def storable(self) -> bool:
        return self not in (GroupKind.CROSS_ATTENTION, GroupKind.ENCODER_ONLY_ATTENTION)


class MambaCacheMode(enum.StrEnum):
    NONE = "none"
    ALL = "all"
    ALIGN = "align"


_DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1,
}


class KVCacheGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One kv-cache group: layers sharing one block table."""

    kind: GroupKind
    block_size: _Tokens
    """Tokens per block; for ``circular_buffer`` the ring capacity."""
    layers: Annotated[tuple[_Name, ...], msgspec.Meta(max_length=8192)] = ()
    enable_kv_transfer: bool = True
    mamba_cache_mode: MambaCacheMode | None = None
    sliding_window: _Count | None = None
    dtype: _Name = "bfloat16"
    page_bytes: Annotated[int, msgspec.Meta(le=1 << 40)] = 0
    """Bytes of one block of one layer (0: not declared; the registered tensors decide)."""
    mla: bool = False
    """Latent attention (MLA, sliding-window MLA): every TP rank holds the same KV."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.page_bytes < 0:
            raise ValueError(f"page_bytes must not be negative, got {self.page_bytes}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(_DTYPE_BYTES)}"
            )
        if len(set(self.layers)) != len(self.layers):
            raise ValueError("layers must be unique within a group")
        if self.kind is GroupKind.MAMBA:
            if self.mamba_cache_mode is None:
                raise ValueError("mamba groups need mamba_cache_mode ('none' | 'all' | 'align')")
        elif self.mamba_cache_mode is not None:
            raise ValueError(f"mamba_cache_mode is only valid for mamba groups, not {self.kind}")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if self.sliding_window is None or self.sliding_window <= 0:
                raise ValueError("sliding_window groups need a positive sliding_window")
        elif self.sliding_window is not None:
            raise ValueError(
                f"sliding_window is only valid for sliding_window groups, not {self.kind}"
            )


class KVCacheLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, dict=True):
    """A model's KV-cache groups in the engine's kv-cache group order, plus its ranks."""

    groups: Annotated[tuple[KVCacheGroup, ...], msgspec.Meta(max_length=64)]
    model: _Name = "model"
    tp_rank: _Count = 0
    pcp_rank: _Count = 0
    dcp_rank: _Count = 0
    pp_rank: _Count = 0
    pcp_world_size: _Count = 1
    """Prefill context-parallel size; stores refuse hybrid layouts when it exceeds 1."""
    tp_size: _Count = 1
    pp_size: _Count = 1
    dcp_size: _Count = 1
    num_kv_heads: _Count = 0
    """The model's KV heads over all TP ranks (0: unknown): ranks share a head's key."""
    store_namespace: _Name = ""
    """vLLM's ``store_namespace`` (``store.value_format: vllm`` keys only)."""
    cache_prefix: _Name = ""
    prefix_match_unit: _Tokens | None = None
    block_size: _Tokens | None = None
    """The engine-wide block size, informational only: group geometry is read per group."""

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a layout needs at least one kv-cache group")
        if not self.model or "@" in self.model:
            raise ValueError(f"model must be non-empty and contain no '@', got {self.model!r}")
        if "@" in self.cache_prefix:
            raise ValueError(f"cache_prefix must contain no '@', got {self.cache_prefix!r}")
        for rank in ("tp_rank", "pcp_rank", "dcp_rank", "pp_rank"):
            if getattr(self, rank) < 0:
                raise ValueError(f"{rank} must not be negative")
        for rank, size in (("tp_rank", "tp_size"), ("pcp_rank", "pcp_world_size"),
                           ("pp_rank", "pp_size"), ("dcp_rank", "dcp_size")):
            if getattr(self, size) <= 0:
                raise ValueError(f"{size} must be positive, got {getattr(self, size)}")
            if getattr(self, rank) >= getattr(self, size):
                raise ValueError(f"{rank} {getattr(self, rank)} must be below {size} "
                                 f"{getattr(self, size)}")
        ranks = self.tp_size * self.pp_size * self.pcp_world_size * self.dcp_size
        if ranks > MAX_RANKS:
            # A lookup's keys fan out over the ranks: their number is work per block.
            raise ValueError(f"tp_size x pp_size x pcp_world_size x dcp_size is {ranks}, "
                             f"more than {MAX_RANKS}")
        if not 0 <= self.num_kv_heads <= MAX_KV_HEADS:
            raise ValueError(
                f"num_kv_heads must be in [0, {MAX_KV_HEADS}], got {self.num_kv_heads}")
        if self.prefix_match_unit is not None and self.prefix_match_unit <= 0:
            raise ValueError(f"prefix_match_unit must be positive, got {self.prefix_match_unit}")
        owners: dict[str, int] = {}
        for group_id, group in enumerate(self.groups):
            for layer in group.layers:
                if layer in owners:
                    raise ValueError(
                        f"layer {layer!r} appears in groups {owners[layer]} and {group_id}"
                    )
                owners[layer] = group_id

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCacheLayout:
        """Load a layout from the plain-dict schema; errors name the offending field."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise LayoutError(f"invalid KV-cache layout: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result

    # -- projections ------------------------------------------------------------------

    @functools.cached_property
    def transfer_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.enable_kv_transfer)

    @functools.cached_property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i in self.transfer_group_ids if self.groups[i].kind.prefix_cacheable)

    @functools.cached_property
    def _store_index(self) -> dict[int, int]:
        return {gid: idx for idx, gid in enumerate(self.prefix_cacheable_group_ids)}

    def store_group_index(self, kv_group_id: int) -> int | None:
        """The store-group index of a kv-cache group, or None if the group is not stored."""
        if not 0 <= kv_group_id < len(self.groups):
            raise LayoutError(f"kv-cache group {kv_group_id} does not exist "
                              f"(layout has {len(self.groups)} groups)")
        return self._store_index.get(kv_group_id)

    @functools.cached_property
    def store_groups(self) -> tuple[KVCacheGroup, ...]:
        """The stored groups, indexed by store-group index."""
        return tuple(self.groups[gid] for gid in self.prefix_cacheable_group_ids)

    def project_block_ids(self, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        """Per-kv-group block ids -> per-store-group block ids (other groups dropped).

        Positions are kept, so index j is still block j of the request; null blocks
        (id 0) stay as placeholders and are never transferred (see ``stored_positions``).
        """
        return self._project(block_ids, self.prefix_cacheable_group_ids)

    def project_transfer_all(self, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        """Per-kv-group block ids -> per-transfer-group block ids, ring included.

        For request-addressed hand-off (prefill -> decode), never for hash-addressed storage.
        """
        return self._project(block_ids, self.transfer_group_ids)

    def _project(
        self, block_ids: Sequence[Sequence[int]], group_ids: tuple[int, ...]
    ) -> tuple[list[int], ...]:
        if len(block_ids) != len(self.groups):
            raise LayoutError(
                f"expected block ids for {len(self.groups)} kv-cache groups, got {len(block_ids)}"
            )
        return tuple(list(block_ids[gid]) for gid in group_ids)

    # -- geometry -----------------------------------------------------------------------

    @functools.cached_property
    def hash_block_size(self) -> int:
        """Tokens per fine block hash, as vLLM 0.33 ``resolve_kv_cache_block_sizes``."""
        sizes = [g.block_size for g in self.groups]
        if len(sizes) == 1:
            return sizes[0]
        if not self._hash_divided_group_ids:
            # A mamba group outside align mode breaks divisibility: the engine backs off.
            return math.lcm(*sizes)
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        return math.gcd(*(self.groups[gid].block_size for gid in self._hash_divided_group_ids))

    @functools.cached_property
    def _hash_divided_group_ids(self) -> tuple[int, ...]:
        """Groups whose block size the engine requires to be a multiple of hash_block_size.

        Every prefix-cacheable group counts, transferred or not (vLLM 0.33 does the same);
        none when the engine backs off to the lcm (single group, or non-align mamba).
        """
        if len(self.groups) == 1 or any(
            g.kind is GroupKind.MAMBA and g.mamba_cache_mode is not MambaCacheMode.ALIGN
            for g in self.groups
        ):
            return ()
        return tuple(i for i, g in enumerate(self.groups) if g.kind.prefix_cacheable) or tuple(
            range(len(self.groups))
        )

    @functools.cached_property
    def lookup_alignment(self) -> int:
        """Token granularity at which a lookup hit may land (ARCHITECTURE §5)."""
        hbs = self.hash_block_size
        if any(
            g.kind is GroupKind.MAMBA and g.mamba_cache_mode is MambaCacheMode.ALIGN
            and g.block_size > hbs
            for g in self.store_groups
        ):
            return hbs
        return math.lcm(*(g.block_size for g in self.store_groups)) if self.store_groups else hbs

    @functools.cached_property
    def payload_layers(self) -> tuple[tuple[str, ...], ...]:
        """Layer names whose tensors carry payload, per store group (nothing else is mapped)."""
        return tuple(g.layers for g in self.store_groups)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the stored geometry and this engine's ranks: incompatible engines
        never share bytes."""
        parts = [self.geometry_fingerprint, f"tp{self.tp_rank}", f"pcp{self.pcp_rank}",
                 f"dcp{self.dcp_rank}", f"pp{self.pp_rank}"]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    @functools.cached_property
    def geometry_fingerprint(self) -> str:
        """Identifies the stored geometry alone, alike on every rank of one engine."""
        parts = [self.model, f"h{self.hash_block_size}",
                 f"tp{self.tp_size}:{self.pcp_world_size}:{self.dcp_size}:{self.pp_size}"]
        for g in self.store_groups:
            parts.append(f"{g.kind}:{g.block_size}:{g.dtype}:{g.page_bytes}:{len(g.layers)}:"
                         f"{g.sliding_window}:{g.mamba_cache_mode}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    # -- validation -----------------------------------------------------------------------

    def validate_for_store(self) -> None:
        """Fail closed unless every prefix-cacheable group can be hashed and stored."""
        stored = self.prefix_cacheable_group_ids
        if not stored:
            raise LayoutError("kvsidecar requires at least one prefix-cacheable KV cache group")
        problems: list[str] = []
        for gid in stored:
            group = self.groups[gid]
            if not group.kind.storable:
                problems.append(f"group {gid}: {group.kind} groups cannot be stored")
            if group.kind is GroupKind.MAMBA and group.mamba_cache_mode is not MambaCacheMode.ALIGN:
                problems.append(
                    f"group {gid}: mamba_cache_mode={str(group.mamba_cache_mode)!r} != 'align'"
                )
        if (len(self.groups) == 1 and self.prefix_match_unit is not None
                and self.prefix_match_unit != self.groups[0].block_size):
            problems.append(
                f"group 0: prefix_match_unit {self.prefix_match_unit} must equal the single "
                f"group's block_size {self.groups[0].block_size}"
            )
        pcp = max(self.pcp_world_size, self.pcp_rank + 1)
        if len(stored) > 1 and pcp > 1:
            problems.append(
                f"groups {list(stored)}: hybrid layouts cannot be stored with PCP > 1 (pcp={pcp})"
            )
        if not problems:
            hbs = self.hash_block_size
            for gid in sorted({*stored, *self._hash_divided_group_ids}):
                if self.groups[gid].block_size % hbs:
                    problems.append(
                        f"group {gid}: block_size {self.groups[gid].block_size} is not a "
                        f"multiple of hash_block_size {hbs}"
                    )
        if problems:
            raise LayoutError("layout cannot be stored: " + "; ".join(problems))
