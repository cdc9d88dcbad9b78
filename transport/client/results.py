"""What the engine side sends and gets back: the results of saves, loads and
explanations, and the request messages built from an engine's arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipeline.core.hashing import MMItem
from pipeline.core.layout import NULL_BLOCK_ID
from pipeline.core.messages import (
    BlockReport,
    BlockWhy,
    Lookup,
    RequestKeys,
    SaveDone,
    pack_tokens,
)
from pipeline.core.outcomes import OVERLOADED, BlockStatus

__all__ = ["Explanation", "LoadResult", "SaveResult", "blocks_of", "hashes", "keys_of",
           "lookup_message", "overloaded"]



@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    stored: int
    present: int
    skipped: int
    failed: int
    blocks: tuple[BlockReport, ...]
    shed: bool = False
    """Never sent: the sidecar had said it would refuse it (``EngineClient.save``)."""

    @classmethod
    def from_reply(cls, reply: SaveDone, *, shed: bool = False) -> SaveResult:
        count = {status: 0 for status in BlockStatus}
        for block in reply.blocks:
            count[block.status] += 1
        return cls(count[BlockStatus.STORED], count[BlockStatus.PRESENT],
                   count[BlockStatus.SKIPPED], count[BlockStatus.FAILED], reply.blocks,
                   shed)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    loaded_tokens: int
    invalid_block_ids: tuple[int, ...]
    blocks: tuple[BlockReport, ...]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """A lookup's hit and, for every full block of every stored group, why it is or is
    not a hit."""

    hit_tokens: int
    blocks: tuple[BlockWhy, ...]


def keys_of(
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MMItem] = (),
) -> RequestKeys:
    return RequestKeys(lora_name, lora_path, cache_salt, tuple(tuple(i) for i in mm_items))  # type: ignore[misc]


def overloaded(request_id: str, block_ids: Sequence[Sequence[int]],
                store_group_ids: Sequence[int]) -> SaveDone:
    """The sidecar's answer to a save it refuses as overloaded: every block of every
    stored group, null blocks left out, skipped."""
    status, reason = OVERLOADED.status, OVERLOADED.reason
    return SaveDone(0, request_id, tuple(
        BlockReport(group_id, index, block_id, status, reason)
        for group_id in store_group_ids
        for index, block_id in enumerate(block_ids[group_id]) if block_id != NULL_BLOCK_ID
    ), save_credits=0)



def lookup_message(
    seq: int, token_ids: Sequence[int], hash_block_size: int | None, *,
    keys: RequestKeys | None = None, block_hashes: Sequence[bytes] | None = None,
    request_id: str | None = None, explain: bool = False,
) -> Lookup:
    """A lookup as an engine sends it. With the engine's block hashes (and no
    explanation asked) only the prompt's first hash block goes, the one its first hash
    is checked against, and the prompt's length: the hashes name every block.
    ``hash_block_size``: the registered layout's (None: not registered; all is sent)."""
    head = block_hashes is not None and not explain and hash_block_size is not None
    return Lookup(seq, pack_tokens(token_ids[:hash_block_size] if head else token_ids),
                  keys or RequestKeys(), hashes(block_hashes), request_id, explain=explain,
                  prompt_tokens=len(token_ids) if head else None)


def hashes(block_hashes: Sequence[bytes] | None) -> tuple[bytes, ...] | None:
    return None if block_hashes is None else tuple(block_hashes)


def blocks_of(block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in ids) for ids in block_ids)

